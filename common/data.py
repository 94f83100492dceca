"""Corpus, tokenizer and fixed-size training blocks for the causal-LM recipes.

The bundled corpus, what `datasets` loads (as `run_clm`), or a data stage's own rows
(`pack_dataset`'s `to_rows`), cached under `cache_dir` by a hash of the inputs: build inside
`launch.node_first` (each node's first rank builds, then renames atomically).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import tempfile
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
from tokenizers import ByteLevelBPETokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from common import checks
from common.errors import Stop, warn

REPO_ROOT = Path(__file__).resolve().parent.parent
CORPUS_DIR = REPO_ROOT / "data" / "shakespeare"
DEFAULT_CACHE_DIR = os.environ.get(
    "ACCELERATE_RECIPES_CACHE", str(Path.home() / ".cache" / "accelerate-recipes")
)
EOS = "<|endoftext|>"
PACKING = ("stream", "documents", "none")  # --packing; `PACKING_ALIASES` keeps true/false working
PACKING_ALIASES = {"true": "stream", "false": "none"}


def load_shakespeare() -> datasets.Dataset:
    """The bundled corpus, each file checked against `SHA256SUMS`: columns `text` (one whole work
    per row) and `work`."""
    sums = CORPUS_DIR / "SHA256SUMS"
    if not sums.is_file():
        raise Stop(
            f"bundled corpus checksum list not found: {sums}; pass --train_file or "
            "--dataset_name, or copy data/shakespeare/ with the recipe"
        )
    texts, works = [], []
    for line in sums.read_text().splitlines():
        digest, name = line.split()
        path = CORPUS_DIR / f"{name}.gz"
        if not path.is_file():
            raise Stop(f"bundled corpus file missing: {path}")
        raw = gzip.decompress(path.read_bytes())
        if hashlib.sha256(raw).hexdigest() != digest:
            raise Stop(f"bundled corpus file {path} does not match its SHA-256 in {sums}")
        texts.append(raw.decode("ascii"))
        works.append(name.removesuffix("_gut.txt"))
    return datasets.Dataset.from_dict({"text": texts, "work": works})


def load_text_dataset(
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    validation_split_percentage: int = 5,
    columns: tuple[tuple[str, ...], ...] = (("text",),),
    bundled: tuple[str, str] | None = None,
    text_field: str = "text",
) -> datasets.DatasetDict:
    """Splits `train` and `validation`, as `run_clm.py`, from a `datasets` name, else the files
    (.txt: a document each; .json/.jsonl/.parquet: a row each), else `bundled`, else the corpus;
    without a validation split, the first `validation_split_percentage`% held out. Each split must
    hold one of the `columns` sets; its `text_field` column becomes `text`."""
    if dataset_name:
        raw = datasets.load_dataset(dataset_name, dataset_config_name)
    elif train_file or bundled:
        train_file, validation_file = (train_file, validation_file) if train_file else bundled
        files = {"train": train_file} | ({"validation": validation_file} if validation_file else {})
        for path in files.values():
            if not Path(path).is_file():
                raise Stop(f"data file not found: {path}")
            if Path(path).stat().st_size == 0:  # `datasets` would end in a StopIteration traceback
                raise Stop(f"data file is empty: {path}")
        builders = {"txt": "text", "json": "json", "jsonl": "json", "parquet": "parquet"}
        kinds = {path: builders.get(Path(path).suffix[1:]) for path in files.values()}
        if bad := [path for path, builder in kinds.items() if builder is None]:
            raise Stop(f"{bad[0]}: extension not supported (txt, json, jsonl, parquet)")
        if len(set(kinds.values())) > 1:
            raise Stop(
                f"--train_file {train_file} and --validation_file {validation_file} must be the "
                "same format"
            )
        builder = kinds[train_file]
        if builder == "text" and not validation_file:  # a lone .txt: its start is held out
            text = Path(train_file).read_text()
            texts = split_text(text, validation_split_percentage, train_file)
            return datasets.DatasetDict(
                {
                    s: datasets.Dataset.from_dict({"text": [t]})
                    for s, t in zip(("train", "validation"), texts)
                }
            )
        # .txt: one document per file, newlines kept (line by line would drop every newline)
        extra = {"sample_by": "document"} if builder == "text" else {}
        raw = datasets.load_dataset(builder, data_files=files, **extra)
    else:
        raw = datasets.DatasetDict({"train": load_shakespeare()})
    if "validation" not in raw:
        n, n_val = len(raw["train"]), max(1, len(raw["train"]) * validation_split_percentage // 100)
        if n_val >= n:
            raise Stop(f"only {n} training rows: too few to hold out a validation split")
        train = raw["train"]
        raw = datasets.DatasetDict(
            train=train.select(range(n_val, n)), validation=train.select(range(n_val))
        )
    for split in ("train", "validation"):
        if text_field != "text":
            if text_field not in raw[split].column_names:
                raise Stop(
                    f"{split} split has no '{text_field}' column (--dataset_text_field; columns: "
                    f"{raw[split].column_names})"
                )
            raw[split] = raw[split].select_columns(text_field).rename_column(text_field, "text")
        if not any(set(names) <= set(raw[split].column_names) for names in columns):
            wanted = " or ".join("+".join(f"'{n}'" for n in names) for names in columns)
            raise Stop(
                f"{split} split has no {wanted} column (columns: {raw[split].column_names}; "
                "--dataset_text_field names the text's)"
            )
        kind = getattr(raw[split].features.get("text"), "dtype", "string")  # (a list: "list")
        nulls = "text" in raw[split].column_names and raw[split].data.column("text").null_count
        if kind not in ("string", "large_string") or nulls:  # (nulls: of the file's rows)
            raise Stop(
                f"{split} split: column '{text_field}' (--dataset_text_field) holds {kind}"
                + (f", {nulls} null" if nulls else "")
                + ": text in every row is needed"
            )
    return raw


def split_text(text: str, validation_percentage: int, name: str = "the text") -> tuple[str, str]:
    """(train, validation) = `text` cut at the blank line nearest to `validation_percentage`% of
    its characters (the start is the validation text), or at the nearest line end where no blank
    line lies within half that share (a title, then one block). Together they give back `text`."""
    start = len(text) - len(text.lstrip())  # leading and trailing blank lines are no boundary
    body = text.strip()
    target = validation_percentage / 100 * len(body)  # characters of validation text wanted
    paragraphs = [start + m.end() for m in re.finditer(r"\n[ \t\r]*\n\s*", body)]
    lines = [start + m.end() for m in re.finditer(r"\n\s*", body)]
    if not lines:
        raise Stop(
            f"{name}: 1 line, too few to hold out {validation_percentage}% for validation and train "
            "on the rest; pass --validation_file"
        )
    nearest = min(paragraphs or lines, key=lambda end: abs(end - start - target))
    if abs(nearest - start - target) > target / 2:
        nearest = min(lines, key=lambda end: abs(end - start - target))
    return text[nearest:], text[:nearest]


def sample_text(split: datasets.Dataset, rows: int | None = 100, start: int = 0) -> list[str]:
    """The text of `rows` rows (None: all) from `start`: the `text` column, else each row as JSON."""
    part = split[start : None if rows is None else start + rows]
    if "text" in part:
        return part["text"]
    return [
        json.dumps(dict(zip(part, r)), sort_keys=True, default=str) for r in zip(*part.values())
    ]


def _digest(*splits: datasets.Dataset) -> str:
    """SHA-256 of the rows' text (`datasets`' fingerprints of in-memory data are random)."""
    h = hashlib.sha256()
    for split in splits:
        for start in range(0, len(split), 10_000):
            for text in sample_text(split, 10_000, start):
                h.update(text.encode() + b"\0")
        h.update(b"|split|")
    return h.hexdigest()


def _atomic_dir(final: Path, build) -> Path:
    """Run `build(tmp_dir)` and rename the result to `final`, unless another job got there first."""
    if not final.exists():
        final.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(
            dir=final.parent, prefix=f".{final.name}.", ignore_cleanup_errors=True
        ) as tmp:
            build(Path(tmp))
            try:
                os.replace(tmp, final)
            except OSError:
                if not final.exists():
                    raise
    return final


def get_tokenizer(
    name_or_path: str | None, raw: datasets.DatasetDict, vocab_size: int, cache_dir: str
):
    """`AutoTokenizer` of `name_or_path`, or a byte-level BPE of `vocab_size` entries trained on
    `raw['train']` (cached): `<|endoftext|>` is its bos, eos, pad and unk, and
    data/chat_template.jinja its chat template (so that recipes/sft.py can fine-tune the model)."""
    if name_or_path:
        tok = AutoTokenizer.from_pretrained(name_or_path)
        if tok.eos_token_id is None:
            raise Stop(f"--tokenizer_name_or_path {name_or_path}: tokenizer has no eos token")
        return tok

    def build(tmp: Path):
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(
            sample_text(raw["train"], None),
            vocab_size=vocab_size,
            min_frequency=2,
            special_tokens=[EOS],
            show_progress=False,
        )
        PreTrainedTokenizerFast(
            tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS
        ).save_pretrained(tmp)

    name = f"tokenizer-bpe{vocab_size}-{_digest(raw['train'])[:16]}"
    tok = AutoTokenizer.from_pretrained(_atomic_dir(Path(cache_dir) / name, build))
    tok.chat_template = (REPO_ROOT / "data" / "chat_template.jinja").read_text()
    return tok


def _source_files(fn, seen: set) -> set[str]:
    """The user's files (outside the Python installation) `fn` reaches, recursively: `datasets`
    hashes a function of another module by its name alone, and an edit there must change the key."""
    import inspect
    import sysconfig
    import types

    installed = tuple(sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib"))
    if not isinstance(fn, types.FunctionType) or fn in seen:
        return set()
    seen.add(fn)
    found, codes = set(), [fn.__code__]
    while codes:  # names used by fn and by the functions defined inside it
        code = codes.pop()
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        found |= {fn.__globals__.get(name) for name in code.co_names}
    found |= {cell.cell_contents for cell in fn.__closure__ or () if cell.cell_contents}
    files = set()
    for obj in [fn, *found]:
        if isinstance(obj, (types.FunctionType, types.ModuleType)):
            path = getattr(inspect.getmodule(obj), "__file__", None)
            if path and not path.startswith(installed):
                files |= {path, *_source_files(obj, seen)}
    return files


def _cache_key(raw, tokenizer, block_size: int, packing: str, to_rows) -> str:
    """16 hex digits over what makes the blocks: the rows, `block_size`, `packing`, the tokenizer
    (not its directory: each node may have its own), `to_rows` and the files it calls into."""
    from datasets.fingerprint import Hasher

    where = tokenizer.name_or_path, tokenizer.init_kwargs
    tokenizer.name_or_path = ""
    tokenizer.init_kwargs = {k: v for k, v in where[1].items() if k != "name_or_path"}
    try:
        made = Hasher.hash([tokenizer, to_rows])
    except Exception as err:  # noqa: BLE001  (whatever dill cannot pickle)
        raise Stop(
            f"to_rows cannot key the data cache ({type(err).__name__}: {err}): let it close over "
            "the values it needs, not the accelerator or args"
        ) from None
    finally:
        tokenizer.name_or_path, tokenizer.init_kwargs = where
    code = sorted(
        hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in _source_files(to_rows, set())
    )
    key = ["v5", _digest(raw["train"], raw["validation"]), made, code, block_size, packing]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def document_ids(tokenizer, texts: list[str]) -> tuple[list[list[int]], dict[str, int]]:
    """(ids of each text, {special-token string: count found}). A text's ids: the template's
    prefix (Llama 3's `<|begin_of_text|>`), its tokens, one eos (the one separator). Special-token
    strings stay text: an eos mid-document would train as a document's end."""
    specials = {
        *tokenizer.all_special_tokens,
        *(t.content for t in tokenizer.added_tokens_decoder.values() if t.special),
    }
    pattern = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))
    found = Counter(m.group() for t in (texts if specials else ()) for m in pattern.finditer(t))
    eos = tokenizer.eos_token_id
    plain, full = tokenizer("a", add_special_tokens=False)["input_ids"], tokenizer("a")["input_ids"]
    start = next(
        (i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0
    )
    prefix = [t for t in full[:start] if t != eos]
    ids = tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return [prefix + row + [eos] for row in ids], found


def _pack_blocks(
    tokens: datasets.Dataset, block_size: int, cache_file: Path, fingerprint: str, documents: bool
) -> tuple[datasets.Dataset, dict]:
    """The rows of `tokens` (`input_ids`, and `labels` of a recipe's own) as one stream cut into
    blocks: block k is tokens [k * block_size, (k + 1) * block_size), so each batch of the map
    reads its own slice of Arrow's flattened view (no copy); only a last partial block is dropped.
    `documents`: `position_ids` too, 0 at each row's and each block's first token, where the label
    is -100. Returns (blocks, {"tokens", "blocks", "dropped_tokens"[, "split_documents"]})."""
    stream = pc.list_flatten(tokens.data.column("input_ids"))  # (no select()ed view: a map's)
    own = pc.list_flatten(tokens.data.column("labels")) if "labels" in tokens.column_names else None
    n_blocks = len(stream) // block_size
    lengths = pc.list_value_length(tokens.data.column("input_ids")).to_numpy()
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)  # rows' first tokens

    def cut(batch):
        first, count = batch["block"][0], len(batch["block"])  # consecutive block numbers
        window = (first * block_size, count * block_size)
        blocks = stream.slice(*window).to_numpy().astype(np.int64).reshape(count, block_size)
        labels = blocks if own is None else own.slice(*window).to_numpy().astype(np.int64)
        labels = labels.reshape(count, block_size)
        if not documents:
            return {"input_ids": blocks, "labels": labels}
        at = np.arange(first * block_size, (first + count) * block_size, dtype=np.int64)
        row_start = starts[np.searchsorted(starts, at, side="right") - 1]
        positions = at - np.maximum(row_start, at // block_size * block_size)
        positions = positions.reshape(count, block_size)
        return {
            "input_ids": blocks,
            "labels": np.where(positions == 0, -100, labels),
            "position_ids": positions,
        }

    columns = ("input_ids", "labels", "position_ids")[: 3 if documents else 2]
    blocks = datasets.Dataset.from_dict({"block": np.arange(n_blocks, dtype=np.int64)}).map(
        cut,
        batched=True,
        batch_size=1000,
        remove_columns=["block"],
        new_fingerprint=fingerprint,
        cache_file_name=str(cache_file),
        features=datasets.Features({k: datasets.List(datasets.Value("int64")) for k in columns}),
    )
    stats = {"tokens": len(stream), "blocks": n_blocks, "dropped_tokens": len(stream) % block_size}
    if documents:  # rows that start in a kept block and end in a later one
        ends = starts + lengths
        split = (starts // block_size < (ends - 1) // block_size) & (starts < n_blocks * block_size)
        stats["split_documents"] = int(split.sum())
    return blocks, stats


def tokenize_rows(split, tokenizer, packing: str, to_rows=None, num_proc=None) -> datasets.Dataset:
    """`pack_dataset`'s token rows of `split` on `num_proc` processes (the same for any count)."""

    def tokenize(batch):
        if to_rows is None:
            ids, found = document_ids(tokenizer, batch["text"])
            if packing != "none":  # an empty row would add a second separator
                ids = [row for row, text in zip(ids, batch["text"]) if text]
            found = [json.dumps(found)] + [""] * (len(ids) - 1) if ids else []
            return {"input_ids": ids, "found": found}
        rows = to_rows(batch)
        ids, labels = rows["input_ids"], rows["labels"]
        if len(ids) != len(labels) or any(len(x) != len(y) for x, y in zip(ids, labels)):
            raise Stop("to_rows made rows whose input_ids and labels differ in length")
        keep = [i for i, row in enumerate(ids) if row]
        rows = {k: [rows[k][i] for i in keep] for k in ("input_ids", "labels")}
        return rows | {"found": [""] * len(keep)}

    procs = min(num_proc or 1, len(split))  # (more processes than rows: refused)
    procs = procs if procs > 1 else None  # (num_proc=1 would still start a pool)
    return split.map(tokenize, batched=True, remove_columns=split.column_names, num_proc=procs)


def pack_stats(lm_data: datasets.DatasetDict) -> dict:
    """`pack_dataset`'s figures of each split ({} if unknown): "rows", "targets" (what the loss
    counts), "digest", "special_text"; packed: "tokens", "blocks", "dropped_tokens"[,
    "split_documents"]; none: "cut_rows", "cut_tokens"."""
    files = lm_data["train"].cache_files
    stats = Path(files[0]["filename"]).parent.parent / "stats.json" if files else None
    return json.loads(stats.read_text()) if stats and stats.is_file() else {}


def same_data(accelerator, lm_data) -> str:
    """Stop unless every rank packed the same train and validation blocks (a collective); returns
    their digest, which the checkpoints record."""
    digest = "-".join(pack_stats(lm_data)[split]["digest"] for split in ("train", "validation"))
    checks.same_on_every_rank(
        accelerator, "data (train and validation text, tokenizer, block size, packing)", digest
    )
    return digest


def pack_dataset(
    raw: datasets.DatasetDict,
    tokenizer,
    block_size: int,
    cache_dir: str,
    packing: str = "stream",
    to_rows=None,
    length_flag: str = "--block_size",
    num_proc: int | None = None,
    tokenized: dict | None = None,
) -> datasets.DatasetDict:
    """`raw`'s train and validation rows as int64 examples of `block_size` tokens: `input_ids`,
    `labels` (unshifted) and, as `packing` says:
    - "stream" (pretraining, run_clm's grouping): a split's rows as one stream cut into blocks;
    - "documents": the same blocks, `position_ids` restarting at each row (a block-diagonal mask);
    - "none": a row each, cut (a warning counts what is lost) and right-padded: `attention_mask`.

    A row is a `text` (`document_ids`), or the data stage's own: `to_rows(batch) -> {"input_ids":
    [[...]], "labels": [[...]]}`, a `datasets` batch of raw rows in, any number of rows out, labels
    -100 where a token is no target ("stream" refuses them: its loss takes every position a
    target). `to_rows` keys the cache with the values it closes over: not `args`. `num_proc`:
    processes that tokenize; `tokenized`: splits `tokenize_rows` made already.
    """
    if packing not in PACKING:
        raise Stop(f"--packing {packing}: choose one of {', '.join(PACKING)}")
    if to_rows is not None and packing == "stream":  # (llama.py's loss count assumes it)
        raise Stop(
            "--packing stream trains on every token of a block: a recipe's own labels need "
            "--packing documents or none"
        )
    key = _cache_key(raw, tokenizer, block_size, packing, to_rows)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos

    def pad_rows(batch):
        rows = [ids[:block_size] for ids in batch["input_ids"]]
        labels = [y[:block_size] for y in batch["labels"]] if "labels" in batch else rows
        fill = [block_size - len(r) for r in rows]
        return {
            "input_ids": [r + [pad] * k for r, k in zip(rows, fill)],
            "labels": [y + [-100] * k for y, k in zip(labels, fill)],
            "attention_mask": [[1] * len(r) + [0] * k for r, k in zip(rows, fill)],
        }

    def build(tmp: Path):
        tokens = datasets.DatasetDict(tokenized or {})
        for s in set(raw) - set(tokens):
            tokens[s] = tokenize_rows(raw[s], tokenizer, packing, to_rows, num_proc)
        stats = {}
        for split in ("train", "validation"):
            parts = tokens[split].select_columns("found").iter(batch_size=10_000)  # not all at once
            found = sum((Counter(json.loads(c)) for p in parts for c in p["found"] if c), Counter())
            lengths = pc.list_value_length(tokens[split].data.column("input_ids")).to_numpy()
            stats[split] = {"rows": len(lengths), "special_text": found}
            if packing == "none":
                cut = np.maximum(lengths - block_size, 0)
                stats[split] |= {"cut_rows": int((cut > 0).sum()), "cut_tokens": int(cut.sum())}
            elif lengths.sum() < block_size:
                held_out = "raise --validation_split_percentage, or pass --validation_file"
                fix = "or add text" if split == "train" else held_out
                raise Stop(
                    f"{split} split has {lengths.sum()} tokens, fewer than one block ({length_flag} "
                    f"{block_size}): lower {length_flag}, {fix}"
                )
        tokens = tokens.remove_columns("found")
        with tempfile.TemporaryDirectory(dir=tmp.parent, prefix=f".{tmp.name}.") as scratch:
            if packing == "none":
                columns = tokens["train"].column_names
                made = tokens.map(pad_rows, batched=True, remove_columns=columns)
            else:
                made = datasets.DatasetDict()
                for split in ("train", "validation"):
                    made[split], packed = _pack_blocks(
                        tokens[split],
                        block_size,
                        Path(scratch) / f"{split}.arrow",
                        f"{key}-{split}",
                        documents=packing == "documents",
                    )
                    stats[split] |= packed
            made.save_to_disk(str(tmp))
        for split, blocks in datasets.load_from_disk(str(tmp)).items():
            digest, targets = hashlib.sha256(), 0
            for part in blocks.with_format("numpy").iter(batch_size=1024):
                targets += int((part["labels"][:, 1:] != -100).sum())  # the model shifts them
                for name in sorted(part):
                    digest.update(part[name].tobytes())
            stats[split] |= {"targets": targets, "digest": digest.hexdigest()[:16]}
        (tmp / "stats.json").write_text(json.dumps(stats))

    path = _atomic_dir(Path(cache_dir) / f"{packing}-{block_size}-{key}", build)
    for split, made in json.loads((path / "stats.json").read_text()).items():
        if counts := ", ".join(f"{s} x {n}" for s, n in sorted(made["special_text"].items())):
            warn(
                f"the {split} text contains special-token strings ({counts}): encoded as the plain "
                "text they are, not as control tokens; the only control token the recipe adds is "
                "one eos after each document"
            )
        if made.get("cut_rows"):
            warn(
                f"--packing none: {made['cut_rows']} of {made['rows']} {split} rows are longer "
                f"than {length_flag} {block_size} and lose their tail ({made['cut_tokens']} tokens "
                f"never {'trained on' if split == 'train' else 'evaluated'}); raise {length_flag} "
                "or pack them (--packing documents)"
            )
    return datasets.load_from_disk(str(path))


def train_and_eval_sets(
    lm_data: datasets.DatasetDict, max_eval_samples: int | None, sample_ids: bool = False
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """`pack_dataset`'s sets, the validation one cut to `max_eval_samples` blocks; with `sample_ids`
    the training blocks gain their index, "sample_id" (--record_sample_ids)."""
    train_set, eval_set = lm_data["train"], lm_data["validation"]
    if sample_ids:
        train_set = train_set.add_column("sample_id", list(range(len(train_set))))
    if max_eval_samples:
        eval_set = eval_set.select(range(min(max_eval_samples, len(eval_set))))
    return train_set, eval_set
