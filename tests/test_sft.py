"""recipes/sft.py: chat fine-tuning, full or LoRA. The tokens with a loss are exactly the
assistant's (an independent count: the template's text, not its tokens); the packing keeps the
labels; every strategy gives one process's answer; a resume is exact; the exports (the adapter,
the merged model) give the live model's logits; each refusal is one line."""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from common import data
from conftest import REPO, launch, read_metrics
from recipes.sft import chat_rows

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from compare_runs import worst_gaps  # noqa: E402

CHAT = REPO / "data" / "chat"
CHAT_COLUMNS = (("messages",), ("prompt", "completion"))


@pytest.fixture(scope="module")
def chat(cache_dir):
    """The bundled chat set and the bundled tokenizer (with its plain-text chat template)."""
    tokenizer = data.get_tokenizer(None, data.load_text_dataset(), 4096, cache_dir)
    raw = data.load_text_dataset(
        columns=CHAT_COLUMNS, bundled=(f"{CHAT}/train.jsonl", f"{CHAT}/validation.jsonl")
    )
    return raw, tokenizer


def test_the_targets_are_the_assistant_tokens(chat, tmp_path):
    raw, tokenizer = chat
    to_rows = chat_rows(tokenizer, None, True)
    for split in ("train", "validation"):
        conversations = raw[split][:]["messages"]
        rows = to_rows(raw[split][:])
        assert (
            len(rows["input_ids"])
            == len(conversations)
            == {"train": 4000, "validation": 400}[split]
        )
        for messages, ids, labels in zip(conversations, rows["input_ids"], rows["labels"]):
            # what the model must learn to say: each reply and the eos that ends it, nothing else
            replies = "".join(
                m["content"] + tokenizer.eos_token for m in messages if m["role"] == "assistant"
            )
            assert tokenizer.decode([t for t, y in zip(ids, labels) if y != -100]) == replies
            assert [y for y in labels if y != -100] == [t for t, y in zip(ids, labels) if y != -100]
            assert ids == list(
                tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
            )
    # --assistant_only_loss false: every token; prompt/completion rows: one exchange
    every = chat_rows(tokenizer, None, False)
    rows = every(raw["validation"][:3])
    assert rows["labels"] == rows["input_ids"]
    pair = to_rows({"prompt": ["Who is there?"], "completion": ["Nay, answer me."]})
    targets = [t for t, y in zip(pair["input_ids"][0], pair["labels"][0]) if y != -100]
    assert tokenizer.decode(targets) == "Nay, answer me." + tokenizer.eos_token

    # stream packing would attend across conversations, and llama.py counts every position a target
    with pytest.raises(ValueError, match="a recipe's own labels need --packing documents or none"):
        data.pack_dataset(raw, tokenizer, 256, str(tmp_path), "stream", to_rows)
    # the labels go through the packing as they are: padded rows, and packed documents (whose
    # first token is no target either way: "###" of a header)
    small = raw.map(lambda b: b, batched=True).filter(lambda _, i: i < 40, with_indices=True)
    for packing in ("none", "documents"):
        packed = data.pack_dataset(
            small, tokenizer, 256, str(tmp_path), packing, to_rows, "--max_length"
        )
        rows = to_rows(small["train"][:])
        made = sum(sum(y != -100 for y in r) for r in rows["labels"])
        kept = sum(sum(y != -100 for y in b) for b in packed["train"]["labels"])
        # the statistics count the targets as the loss does: past each block's first position
        assert data.pack_stats(packed)["train"]["targets"] == sum(
            sum(y != -100 for y in b[1:]) for b in packed["train"]["labels"]
        )
        if packing == "none":  # rows under 256 tokens: each padded row's labels are its own
            assert all(len(r) <= 256 for r in rows["input_ids"]) and kept == made
            assert packed["train"][0]["labels"][: len(rows["labels"][0])] == rows["labels"][0]
            # the label rule keys the cache, and the blocks' digest (the resume's fingerprint)
            every_token = data.pack_dataset(
                small, tokenizer, 256, str(tmp_path), packing, every, "--max_length"
            )
            assert every_token["train"].cache_files != packed["train"].cache_files
            digests = [data.pack_stats(d)["train"]["digest"] for d in (packed, every_token)]
            assert digests[0] != digests[1]
        else:  # the last partial block dropped; a split row's next block restarts at a non-target
            stats = data.pack_stats(packed)["train"]
            assert 0 < made - kept <= stats["dropped_tokens"] + stats["split_documents"], (
                made,
                kept,
                stats,
            )


def test_a_template_that_is_not_prefix_stable_is_refused(chat):
    raw, tokenizer = chat
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    # a closing separator after each reply: the next turn's header merges with it into other tokens
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
    )
    to_rows = chat_rows(tokenizer, None, True)
    with pytest.raises(
        ValueError, match="the chat template is not prefix-stable: in the conversation that starts"
    ):
        to_rows(raw["train"][:8])
    tokenizer.chat_template = None
    with pytest.raises(
        ValueError, match="the tokenizer has no chat template: pass --chat_template FILE"
    ):
        chat_rows(tokenizer, None, True)
    with pytest.raises(ValueError, match="--chat_template nope.jinja: no such file"):
        chat_rows(tokenizer, "nope.jinja", True)


# ---- Launched: every strategy against one process, LoRA and full, fp32 ---------------------------
STRATEGIES = ["ddp", "fsdp", "fsdp1", "deepspeed_zero2", "deepspeed_zero3"]
OFFLOAD = "deepspeed_zero3_offload"  # LoRA only: full training's offload path is llama.py's (test_zero3_offload.py)
# 4 steps of a 16-conversation global batch (4 x 2 x 2 ranks; one process: 4 x 4); no LoRA dropout,
# whose masks depend on how the batch is split
FLAGS = [
    "--max_length",
    256,
    "--per_device_train_batch_size",
    4,
    "--max_steps",
    4,
    "--warmup_steps",
    0,
    "--learning_rate",
    1e-2,
    "--max_eval_samples",
    16,
    "--logging_steps",
    1,
    "--eval_steps",
    4,
    "--sample_tokens",
    0,
    "--report_to",
    "none",
    "--ddp_timeout",
    120,
]
LORA = ["--use_peft", "--lora_r", 8, "--lora_dropout", 0]
# measured: loss 7.1e-8, grad norm 2.1e-7 (LoRA, ZeRO-3 offload), eval loss 1.2e-7 (the same), over 4 steps
RTOL = {"loss": 1e-6, "grad_norm": 2e-6, "eval_loss": 1e-6}


@pytest.fixture(scope="module")
def base(tmp_path_factory, chat):
    """A small pretrained Llama (2 layers, hidden 64) with the bundled tokenizer: what sft.py
    fine-tunes. Its config says eos 2; the data's eos (the tokenizer's) replaces it."""
    _, tokenizer = chat
    path = tmp_path_factory.mktemp("base") / "llama"
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def sft_run(out, config, base, cache_dir, *args):
    accumulation = 4 if config == "single" else 2
    launch(
        config,
        "recipes/sft.py",
        "--output_dir",
        out,
        "--model_name_or_path",
        base,
        *FLAGS,
        "--gradient_accumulation_steps",
        accumulation,
        *args,
        cache_dir=cache_dir,
        mixed_precision="no",
    )
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory, base, cache_dir):
    """One process, LoRA and full: the answers every strategy must give."""
    root = tmp_path_factory.mktemp("sft_single")
    return {
        kind: sft_run(root / kind, "single", base, cache_dir, *(LORA if kind == "lora" else []))
        for kind in ("lora", "full")
    }


def assert_same_answer(run, ref):
    gaps = worst_gaps(run, ref)
    assert gaps["steps"] == 4 and gaps["lr"] == 0, gaps
    for key, bound in RTOL.items():
        assert gaps[key] is not None and gaps[key] <= bound, (key, gaps)


def assert_exact_resume(out, config, base, tmp_path, cache_dir, *args):
    """New processes resume `out`'s checkpoint-2 into another folder: steps 3-4 as the uninterrupted
    run's (measured: bit-equal under every strategy, LoRA and full; 1e-7 relative allowed)."""
    resumed = sft_run(
        tmp_path / "resumed",
        config,
        base,
        cache_dir,
        *args,
        "--resume_from_checkpoint",
        out / "checkpoint-2",
    )
    want = {r["step"]: r for r in read_metrics(out)[0]}
    got = read_metrics(resumed)[0]
    assert [r["step"] for r in got] == [3, 4]
    timing = {"tokens_per_second", "data_wait_share", "peak_memory_bytes"}
    for r in got:
        assert r.keys() - timing == want[r["step"]].keys() - timing
        for key in {
            "loss",
            "grad_norm",
            "lr",
            "eval_loss",
            "input_tokens",
            "target_tokens",
        } & r.keys():
            assert r[key] == pytest.approx(want[r["step"]][key], rel=1e-7, abs=1e-12), (
                r["step"],
                key,
            )


@pytest.mark.parametrize("config", [*STRATEGIES, OFFLOAD])
def test_lora_under_every_strategy(config, base, reference, tmp_path, cache_dir):
    """LoRA trains the adapters only and gives one process's answer; its checkpoint holds the
    adapters and not the frozen base, and a resume from it is exact; the adapter export, on its
    base, and the merged export give the live model's logits."""
    out = sft_run(
        tmp_path / config, config, base, cache_dir, *LORA, "--save_logits_probe", "--save_steps", 2
    )
    assert_same_answer(out, reference["lora"])
    assert_exact_resume(out, config, base, tmp_path, cache_dir, *LORA)
    # the checkpoint's model files, read in their own formats: every adapter tensor (28), no base
    # weight (measured 58-247 kB, ZeRO-3 to FSDP, against the base's 2.43 MB)
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(task_type="CAUSAL_LM", r=8, target_modules="all-linear"),
    )
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    keys, size = checkpoint_model_keys(out / "checkpoint-2")
    assert keys == trainable and len(keys) == 28, (
        sorted(keys - trainable)[:3],
        sorted(trainable - keys)[:3],
    )
    assert size < (base / "model.safetensors").stat().st_size / 4, size  # 2.5x the largest measured
    steps, (summary,) = read_metrics(out)
    assert steps[0]["loss"] > steps[-1]["loss"] + 0.05, steps  # it learns (measured 8.35 -> 8.23)
    # the targets are the assistant's tokens, counted over the ranks: about a third of the tokens
    assert 0.25 < summary["target_tokens"] / summary["input_tokens"] < 0.45, summary
    adapter = load_file(out / "final/adapter/adapter_model.safetensors")
    # all-linear: 7 projections a layer, 2 layers, A and B each; B starts at 0 and has trained
    assert len(adapter) == 2 * 7 * 2 and all("lora_" in k for k in adapter), sorted(adapter)
    assert min(v.abs().max() for k, v in adapter.items() if "lora_B" in k) > 0
    probe = load_file(out / "final_logits.safetensors")
    from peft import PeftModel

    merged = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), out / "final/adapter"
    )
    with torch.no_grad():
        # measured: 0 for the adapter on its base, 1.9e-6 for the merged weights (logits about 10)
        assert (adapted(probe["input_ids"]).logits - probe["logits"]).abs().max() < 1e-5
        assert (merged(probe["input_ids"]).logits - probe["logits"]).abs().max() < 2e-5
    # the base's eos (2) is replaced by the data's, in the exported configs
    eos = AutoTokenizer.from_pretrained(out / "final").eos_token_id
    assert merged.config.eos_token_id == merged.generation_config.eos_token_id == eos != 2


@pytest.mark.parametrize("config", STRATEGIES)
def test_full_fine_tuning_under_every_strategy(config, base, reference, tmp_path, cache_dir):
    out = sft_run(tmp_path / config, config, base, cache_dir, "--save_steps", 2)
    assert_same_answer(out, reference["full"])
    assert_exact_resume(out, config, base, tmp_path, cache_dir)
    assert not (out / "final" / "adapter").exists()


def test_refusals_are_one_line(monkeypatch, base, tmp_path, cache_dir):
    from conftest import run_in_process

    assert run_in_process(monkeypatch, "recipes/sft.py", "--output_dir", tmp_path / "a") == (
        "error: sft.py fine-tunes a pretrained model: pass --model_name_or_path (e.g. runs/llama/final, the export "
        "of recipes/llama.py)"
    )
    assert run_in_process(
        monkeypatch,
        "recipes/sft.py",
        "--output_dir",
        tmp_path / "b",
        "--model_name_or_path",
        base,
        "--lora_alpha",
        8,
    ) == ("error: --lora_alpha sets LoRA, which is off: add --use_peft, or drop the LoRA flags")
    # a module the model does not have: peft's reason, in one line on every rank
    proc = launch(
        "single",
        "recipes/sft.py",
        "--output_dir",
        tmp_path / "c",
        "--model_name_or_path",
        base,
        *FLAGS,
        "--use_peft",
        "--lora_target_modules",
        "q_proj,attn_out",
        cache_dir=cache_dir,
        mixed_precision="no",
        check=False,
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    # (peft itself stops only when no name matches: it adapted q_proj alone, silently)
    assert proc.returncode != 0 and lines == [
        "error: --lora_target_modules q_proj,attn_out: no module named attn_out in the model (adapted: q_proj)"
    ], proc.stderr[-3000:]
    # a resume under other LoRA settings would train another model: the checkpoint's are named
    from common.checkpoint import check_resume
    from common.errors import Stop

    lora = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}
    saved = {"step": 2, "lora": lora, "distributed_type": "MULTI_CPU", "world_size": 2}
    with pytest.raises(Stop) as error:
        check_resume(
            tmp_path / "checkpoint-2",
            saved,
            {**saved, "lora": {**lora, "r": 16}, "max_steps": 4},
            ["lora"],
        )
    assert str(error.value) == (
        f"cannot resume from {tmp_path / 'checkpoint-2'}: lora.r 8 -> 16. Resume with the saved "
        "settings, or start a new run (into another --output_dir) from its weights"
    )


def checkpoint_model_keys(checkpoint):
    """The parameter names a checkpoint's model files hold, read from their own formats (without the
    strategies' wrapper prefixes), and the bytes of those files."""
    import torch
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemReader

    files = [
        f
        for f in checkpoint.rglob("*")
        if f.is_file()
        and (
            f.name == "model.safetensors"
            or "pytorch_model_fsdp_" in str(f)
            or f.name.endswith("model_states.pt")
        )
    ]
    keys = set()
    for f in files:
        if f.name == "model.safetensors":  # single process, DDP
            with safe_open(f, framework="pt") as tensors:
                keys |= set(tensors.keys())
        elif f.name.endswith(
            "model_states.pt"
        ):  # DeepSpeed: the module's state dict (rank 0's file)
            keys |= set(torch.load(f, map_location="cpu", weights_only=True)["module"])
    for folder in {
        f.parent for f in files if "pytorch_model_fsdp_" in f.parent.name
    }:  # FSDP: DCP metadata
        keys |= {
            k.removeprefix("model.")
            for k in FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        }
    return {k.removeprefix("module.") for k in keys}, sum(f.stat().st_size for f in files)


def test_a_lora_load_that_misses_the_adapters_or_the_base_is_refused(base, tmp_path, monkeypatch):
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

    from common import causal_lm, checkpoint
    from common.errors import Stop

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(cpu=True)
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(base),
            LoraConfig(task_type="CAUSAL_LM", r=4, target_modules="all-linear"),
        )
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
        monkeypatch.setattr(
            accelerator, "load_state", lambda *args, **kwargs: None
        )  # loads nothing
        with pytest.raises(
            Stop,
            match=rf"cannot resume from {path}: {len(lora)} of its {len(lora)} trainable "
            r"parameters did not load \(first: base_model\.model\.",
        ):
            checkpoint.load_checkpoint(accelerator, path, model, optimizer, 1)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    moved, other = tmp_path / "moved", tmp_path / "other"
    shutil.copytree(base, moved)
    changed = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        changed.model.layers[1].mlp.down_proj.weight.mul_(1.01)
    changed.save_pretrained(other)
    digest = causal_lm.weights_digest(str(base))
    assert digest and causal_lm.weights_digest(str(moved)) == digest != causal_lm.weights_digest(
        str(other)
    )
    state = {
        "frozen_base": causal_lm.weights_digest(str(other)),
        "world_size": 1,
        "distributed_type": "NO",
        "max_steps": 4,
    }
    with pytest.raises(Stop) as error:
        checkpoint.check_resume(path, {"step": 2, "frozen_base": digest}, state, ["frozen_base"])
    assert str(error.value).startswith(
        f"cannot resume from {path}: frozen_base {digest} -> {state['frozen_base']} "
        "(the frozen base model's weights: --model_name_or_path)"
    ), error.value


def test_lora_with_gradient_checkpointing_and_packed_conversations(base, tmp_path, cache_dir):
    """--packing documents (conversations packed, none attending to another) and activation
    checkpointing, under FSDP2, give one process's answer without either: the same targets, the
    same gradients (measured: loss 1.1e-7, grad norm 1.1e-8 relative over 4 steps)."""
    packed = ["--packing", "documents", "--max_length", 512]
    ref = sft_run(tmp_path / "single", "single", base, cache_dir, *LORA, *packed)
    out = sft_run(
        tmp_path / "fsdp", "fsdp", base, cache_dir, *LORA, *packed, "--gradient_checkpointing"
    )
    assert_same_answer(out, ref)
    info = json.loads((out / "run_info.json").read_text())
    assert info["data"]["train"]["rows"] == 4000 and info["data"]["train"]["blocks"] > 0, info[
        "data"
    ]["train"]


def test_a_reply_cut_whole_still_ends_the_run_with_a_sample(base, tmp_path, cache_dir):
    """--max_length 32 cuts the first validation conversation before its reply: the end-of-run
    sample takes the conversation as it is (it found no target to stop at, and crashed)."""
    proc = launch(
        "single",
        "recipes/sft.py",
        "--output_dir",
        tmp_path,
        "--model_name_or_path",
        base,
        *FLAGS,
        "--max_length",
        32,
        "--max_steps",
        1,
        "--sample_tokens",
        4,
        cache_dir=cache_dir,
        mixed_precision="no",
    )
    assert "--- sample from" in proc.stdout and "done: 1 steps" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_hsdp_gives_one_process_answer(kind, base, reference, tmp_path, cache_dir):
    """hsdp.yaml (FSDP2 on a 2 x 2 mesh, 4 ranks, micro batch 4, no accumulation): the same 16
    conversations a step (measured: loss 6.1e-8, grad norm 3.8e-8, eval loss 1.3e-7 relative at
    most; its LoRA resume, by hand, bit-equal)."""
    out = tmp_path / "hsdp"
    launch(
        "hsdp",
        "recipes/sft.py",
        "--output_dir",
        out,
        "--model_name_or_path",
        base,
        *FLAGS,
        *(LORA if kind == "lora" else []),
        cache_dir=cache_dir,
        mixed_precision="no",
    )
    assert_same_answer(out, reference[kind])
