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


# ---- LoRA checkpoints: the adapters and their optimizer state, not the frozen base; an exact resume

LORA_STRATEGIES = ["ddp", "fsdp", "fsdp1", "deepspeed_zero2", "deepspeed_zero3"]


@pytest.fixture(scope="module")
def small_base(tmp_path_factory, cache_dir):
    """A small pretrained Llama (2 layers, width 64) with the bundled tokenizer and its chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("base")
    tokenizer = data.get_tokenizer(None, data.load_text_dataset(), 4096, cache_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def lora_args(out, base, *extra):
    return ["--model_name_or_path", base, "--output_dir", out, "--use_peft", "--lora_dropout", 0, "--max_steps", 4,
            "--save_steps", 2, "--warmup_steps", 1, "--max_length", 256, "--per_device_train_batch_size", 4,
            "--gradient_accumulation_steps", 2, "--max_eval_samples", 16, "--logging_steps", 1, "--eval_steps", 4,
            "--sample_tokens", 0, "--report_to", "none", "--ddp_timeout", 120, *extra]


def checkpoint_model_keys(checkpoint):
    """The parameter names a checkpoint's model files hold, read from their own formats (without the
    strategies' wrapper prefixes), and the bytes of those files."""
    import torch
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemReader

    files = [f for f in checkpoint.rglob("*") if f.is_file() and (
        f.name == "model.safetensors" or "pytorch_model_fsdp_" in str(f) or f.name.endswith("model_states.pt"))]
    keys = set()
    for f in files:
        if f.name == "model.safetensors":  # single process, DDP
            with safe_open(f, framework="pt") as tensors:
                keys |= set(tensors.keys())
        elif f.name.endswith("model_states.pt"):  # DeepSpeed: the module's state dict (rank 0's file)
            keys |= set(torch.load(f, map_location="cpu", weights_only=True)["module"])
    for folder in {f.parent for f in files if "pytorch_model_fsdp_" in f.parent.name}:  # FSDP: DCP metadata
        keys |= {k.removeprefix("model.") for k in FileSystemReader(str(folder)).read_metadata().state_dict_metadata}
    return {k.removeprefix("module.") for k in keys}, sum(f.stat().st_size for f in files)


@pytest.mark.parametrize("config", LORA_STRATEGIES)
def test_a_lora_checkpoint_holds_the_adapters_and_resumes_exactly(config, small_base, tmp_path, cache_dir):
    """4 steps of LoRA saving at step 2, then new processes resume checkpoint-2 into another directory:
    steps 3-4 give the uninterrupted run's loss, grad norm and LR (measured: bit-equal on all five; the
    assert allows 1e-7 relative), and the checkpoint's model files hold the adapters, every one (28
    tensors), and no weight of the frozen base: 58-247 kB of model files (ZeRO-3 to FSDP) against the
    base's 2.43 MB, where they held the whole base before."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from conftest import launch, read_metrics

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    launch(config, "recipes/sft.py", *lora_args(straight, small_base), cache_dir=cache_dir, mixed_precision="no")
    launch(config, "recipes/sft.py", *lora_args(resumed, small_base, "--resume_from_checkpoint",
                                                straight / "checkpoint-2"), cache_dir=cache_dir, mixed_precision="no")
    want = {r["step"]: r for r in read_metrics(straight)[0]}
    got = read_metrics(resumed)[0]
    assert [r["step"] for r in got] == [3, 4]
    for r in got:
        for key in ("loss", "grad_norm", "lr"):
            assert r[key] == pytest.approx(want[r["step"]][key], rel=1e-7, abs=1e-12), (config, r["step"], key)

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(small_base),
                                LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, target_modules="all-linear"))
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in peft_model.named_parameters() if not p.requires_grad}
    keys, size = checkpoint_model_keys(straight / "checkpoint-2")
    assert keys == trainable, (config, sorted(keys - trainable)[:3], sorted(trainable - keys)[:3])
    assert not keys & frozen
    base_bytes = (small_base / "model.safetensors").stat().st_size
    assert size < base_bytes / 2, (config, size, base_bytes)


def test_a_lora_load_that_misses_the_adapters_or_the_base_is_refused(small_base, tmp_path, monkeypatch):
    """In one process: the checkpoint holds the adapters only and loads them back exactly; a load that
    leaves them as they were (what a wrong key filter or FSDP1's adapter_only did, silently) stops with
    one line; another base (other weights, same shapes) is refused at resume, a moved copy is not."""
    import shutil

    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from peft import LoraConfig, get_peft_model
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from common import checkpoint, models
    from common.errors import Stop

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(cpu=True)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(small_base),
                               LoraConfig(task_type="CAUSAL_LM", r=4, target_modules="all-linear"))
        lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
        optimizer = torch.optim.AdamW(lora.values(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        with torch.no_grad():
            for p in lora.values():
                p.normal_()
        saved = {n: p.detach().clone() for n, p in lora.items()}
        path = checkpoint.save_checkpoint(accelerator, str(tmp_path), 1)
        with safe_open(path / "model.safetensors", framework="pt") as f:
            assert set(f.keys()) == set(lora)

        def scramble():
            with torch.no_grad():
                for p in lora.values():
                    p.add_(1.0)
        scramble()
        checkpoint.load_checkpoint(accelerator, path, model, optimizer, 1)
        assert all(torch.equal(p, saved[n]) for n, p in lora.items())
        scramble()
        monkeypatch.setattr(accelerator, "load_state", lambda *args, **kwargs: None)  # loads nothing
        with pytest.raises(Stop, match=rf"cannot resume from {path}: {len(lora)} of its {len(lora)} trainable "
                                       r"parameters did not load \(first: base_model\.model\."):
            checkpoint.load_checkpoint(accelerator, path, model, optimizer, 1)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    moved, other = tmp_path / "moved", tmp_path / "other"
    shutil.copytree(small_base, moved)
    base = AutoModelForCausalLM.from_pretrained(small_base)
    with torch.no_grad():
        base.model.layers[1].mlp.down_proj.weight.mul_(1.01)
    base.save_pretrained(other)
    digest = models.weights_digest(str(small_base))
    assert digest and models.weights_digest(str(moved)) == digest != models.weights_digest(str(other))
    state = {"frozen_base": models.weights_digest(str(other)), "world_size": 1, "distributed_type": "NO",
             "max_steps": 4}
    error = checkpoint.resume_error(path, {"step": 2, "frozen_base": digest}, state, ["frozen_base"])
    assert error.startswith(f"cannot resume from {path}: frozen_base {digest} -> {state['frozen_base']} "
                            "(the frozen base model's weights: --model_name_or_path)"), error
