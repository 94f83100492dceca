"""recipes/sft.py: chat fine-tuning, full or LoRA. The tokens with a loss are exactly the
assistant's (an independent count: the template's text, not its tokens); the packing keeps the
labels; every strategy gives one process's answer; a resume is exact; the exports (the adapter,
the merged model) give the live model's logits; each refusal is one line."""

import runpy

import pytest
from transformers import AutoTokenizer

from common import data
from conftest import REPO

CHAT = REPO / "data" / "chat"
CHAT_COLUMNS = (("messages",), ("prompt", "completion"))


@pytest.fixture(scope="module")
def sft():
    """recipes/sft.py's module-level names (its functions), without running main()."""
    return runpy.run_path(str(REPO / "recipes" / "sft.py"), run_name="sft_under_test")


@pytest.fixture(scope="module")
def chat(cache_dir):
    """The bundled chat set and the bundled tokenizer (with its plain-text chat template)."""
    tokenizer = data.get_tokenizer(None, data.load_text_dataset(), 4096, cache_dir)
    raw = data.load_text_dataset(columns=CHAT_COLUMNS, bundled=(f"{CHAT}/train.jsonl", f"{CHAT}/validation.jsonl"))
    return raw, tokenizer


def test_the_targets_are_the_assistant_tokens(sft, chat, tmp_path):
    from accelerate import PartialState

    PartialState()  # Accelerate's logger (pack_dataset's warnings) needs the (one-process) state
    raw, tokenizer = chat
    to_rows, rows_key = sft["chat_rows"](tokenizer, None, True)
    for split in ("train", "validation"):
        conversations = raw[split][:]["messages"]
        rows = to_rows(raw[split][:])
        assert len(rows["ids"]) == len(conversations) == {"train": 4000, "validation": 400}[split]
        for messages, ids, labels in zip(conversations, rows["ids"], rows["labels"]):
            # what the model must learn to say: each reply and the eos that ends it, nothing else
            replies = "".join(m["content"] + tokenizer.eos_token for m in messages if m["role"] == "assistant")
            assert tokenizer.decode([t for t, y in zip(ids, labels) if y != -100]) == replies
            assert [y for y in labels if y != -100] == [t for t, y in zip(ids, labels) if y != -100]
            assert ids == list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
    # --assistant_only_loss false: every token; prompt/completion rows: one exchange
    every, key = sft["chat_rows"](tokenizer, None, False)
    rows = every(raw["validation"][:3])
    assert rows["labels"] == rows["ids"] and key != rows_key
    pair = to_rows({"prompt": ["Who is there?"], "completion": ["Nay, answer me."]})
    targets = [t for t, y in zip(pair["ids"][0], pair["labels"][0]) if y != -100]
    assert tokenizer.decode(targets) == "Nay, answer me." + tokenizer.eos_token

    # the labels go through the packing as they are: padded rows, and packed documents (whose
    # first token is no target either way: "###" of a header)
    small = raw.map(lambda b: b, batched=True).filter(lambda _, i: i < 40, with_indices=True)
    for packing in ("none", "documents"):
        packed = data.pack_dataset(small, tokenizer, 256, str(tmp_path), packing, to_rows, rows_key, "--max_length")
        rows = to_rows(small["train"][:])
        made = sum(sum(y != -100 for y in r) for r in rows["labels"])
        kept = sum(sum(y != -100 for y in b) for b in packed["train"]["labels"])
        if packing == "none":  # rows under 256 tokens: each padded row's labels are its own
            assert all(len(r) <= 256 for r in rows["ids"]) and kept == made
            assert packed["train"][0]["labels"][:len(rows["labels"][0])] == rows["labels"][0]
        else:  # the last partial block dropped; a split row's next block restarts at a non-target
            stats = data.pack_stats(packed)["train"]
            assert 0 < made - kept <= stats["dropped_tokens"] + stats["split_documents"], (made, kept, stats)


def test_a_template_that_is_not_prefix_stable_is_refused(sft, chat):
    raw, tokenizer = chat
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    # a closing separator after each reply: the next turn's header merges with it into other tokens
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n\n' }}{% endfor %}"
                               "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
    to_rows, _ = sft["chat_rows"](tokenizer, None, True)
    with pytest.raises(ValueError, match="the chat template is not prefix-stable: in the conversation that starts"):
        to_rows(raw["train"][:8])
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template: pass --chat_template FILE"):
        sft["chat_rows"](tokenizer, None, True)
    with pytest.raises(ValueError, match="--chat_template nope.jinja: no such file"):
        sft["chat_rows"](tokenizer, "nope.jinja", True)
