"""Corpus, tokenizer and packed language-modelling datasets.

The default input is the bundled Shakespeare corpus (`data/shakespeare`, 42 works, checked
against `SHA256SUMS`), a byte-level BPE trained on it with `tokenizers`, and blocks of
`block_size` tokens. `--dataset_name` / `--train_file` load anything `datasets` can, with the
transformers `run_clm` conventions.

Everything expensive is cached under `cache_dir`, keyed by a hash of its inputs, and written
through a temporary directory plus an atomic rename, so concurrent jobs never see half a cache.
Call the builders inside `accelerator.local_main_process_first()`: each node's first rank builds, the others load.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import datasets
from accelerate.logging import get_logger
from tokenizers import ByteLevelBPETokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from common.errors import Stop

REPO_ROOT = Path(__file__).resolve().parent.parent
CORPUS_DIR = REPO_ROOT / "data" / "shakespeare"
DEFAULT_CACHE_DIR = os.environ.get(
    "ACCELERATE_RECIPES_CACHE", str(Path.home() / ".cache" / "accelerate-recipes")
)
EOS = "<|endoftext|>"


def load_shakespeare() -> datasets.Dataset:
    """The bundled corpus as a `Dataset` with columns `text` (one whole work per row) and `work`.

    Raises:
        FileNotFoundError: the corpus directory or one of the files named in `SHA256SUMS` is missing.
        ValueError: a file's SHA-256 does not match `SHA256SUMS` (names the file).
    """
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
) -> datasets.DatasetDict:
    """Raw text splits `train` and `validation`, as in transformers' `run_clm.py`.

    Sources, first match wins: a hub or local `datasets` name; `train_file`/`validation_file`
    (.txt, one document per file, newlines kept; .json/.jsonl or .parquet, one document per row;
    both files of one format); else the `bundled` (train, validation) files, or the bundled
    corpus (one document per work). Each split must hold one of the `columns` sets (chat data:
    `(("messages",), ("prompt", "completion"))`).
    Without a validation split, the first `validation_split_percentage`% of training rows
    are held out (at least one row). A lone .txt `train_file` is cut instead, at the blank
    line (or line end) nearest to `validation_split_percentage`% of its characters: the start
    becomes the validation document and the rest the training document (`split_text`).

    Returns:
        `DatasetDict` with a `text` column (or one of the `columns` sets) in both splits.

    Raises:
        FileNotFoundError: a data file does not exist (names it).
        ValueError: an empty data file, unsupported extension, no `text` column, or a split left empty.
    """
    if dataset_name:
        raw = datasets.load_dataset(dataset_name, dataset_config_name)
    elif train_file or bundled:
        train_file, validation_file = (train_file, validation_file) if train_file else bundled
        files = {
            "train": train_file,
            **({"validation": validation_file} if validation_file else {}),
        }
        for path in files.values():
            if not Path(path).is_file():
                raise Stop(f"data file not found: {path}")
            if Path(path).stat().st_size == 0:  # `datasets` would end in a StopIteration traceback
                raise Stop(f"data file is empty: {path}")
        builders = {"txt": "text", "json": "json", "jsonl": "json", "parquet": "parquet"}
        kinds = {path: builders.get(Path(path).suffix.lstrip(".")) for path in files.values()}
        for path, builder in kinds.items():
            if builder is None:
                raise Stop(f"{path}: extension not supported (txt, json, jsonl, parquet)")
        if len(set(kinds.values())) > 1:
            raise Stop(
                f"--train_file {train_file} and --validation_file {validation_file} must be the same format"
            )
        builder = kinds[train_file]
        if builder == "text" and not validation_file:  # a lone .txt: cut off the validation share
            train, validation = split_text(
                Path(train_file).read_text(), validation_split_percentage, train_file
            )
            return datasets.DatasetDict(
                {
                    "train": datasets.Dataset.from_dict({"text": [train]}),
                    "validation": datasets.Dataset.from_dict({"text": [validation]}),
                }
            )
        # .txt: one document per file, newlines kept (line by line would drop every newline)
        extra = {"sample_by": "document"} if builder == "text" else {}
        raw = datasets.load_dataset(builder, data_files=files, **extra)
    else:
        raw = datasets.DatasetDict({"train": load_shakespeare()})
    if "validation" not in raw:
        n_val = max(1, len(raw["train"]) * validation_split_percentage // 100)
        if n_val >= len(raw["train"]):
            raise Stop(
                f"only {len(raw['train'])} training rows: too few to hold out a validation split"
            )
        raw = datasets.DatasetDict(
            {
                "train": raw["train"].select(range(n_val, len(raw["train"]))),
                "validation": raw["train"].select(range(n_val)),
            }
        )
    for split in ("train", "validation"):
        if not any(set(names) <= set(raw[split].column_names) for names in columns):
            wanted = " or ".join("+".join(f"'{n}'" for n in names) for names in columns)
            raise Stop(f"{split} split has no {wanted} column (columns: {raw[split].column_names})")
    return raw


def split_text(text: str, validation_percentage: int, name: str = "the text") -> tuple[str, str]:
    """Cut one text into (train, validation) at a paragraph boundary, both with newlines kept.

    The validation text is the start of `text`, up to the paragraph boundary (a blank line)
    nearest to `validation_percentage`% of its characters. Where no paragraph boundary lies
    within half that share of the mark (a title, then one long block), the nearest line boundary
    is used instead. Counting characters rather than paragraphs keeps a short title from
    becoming the whole validation split. Concatenated, the two give back `text` exactly.

    Raises:
        ValueError: a text of one line (names `name` and says what to pass instead).
    """
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


def _text_digest(*splits: datasets.Dataset) -> str:
    """SHA-256 of the rows: the same on every rank and every run (fingerprints of in-memory
    datasets are random, so they cannot key a cache). A `text` column is hashed as its strings
    (what the text recipes train on); without one, each row as JSON (chat `messages`, ...)."""
    h = hashlib.sha256()
    for split in splits:
        for i in range(0, len(split), 10_000):
            part = split[i : i + 10_000]
            if "text" in part:
                values = part["text"]
            else:
                values = [json.dumps(row, sort_keys=True, default=str) for row in _rows(part)]
            for value in values:
                h.update(value.encode() + b"\0")
        h.update(b"|split|")
    return h.hexdigest()


def _rows(batch: dict[str, list]) -> list[dict]:
    """A `datasets` batch (column -> values) as its rows (dicts)."""
    return [dict(zip(batch, values)) for values in zip(*batch.values())]


def sample_text(split: datasets.Dataset, rows: int = 100) -> list[str]:
    """The text of the first `rows` rows, for tokenizer checks: the `text` column, else every
    string a row holds (a chat row's contents), joined by newlines."""
    part = split[:rows]
    if "text" in part:
        return part["text"]

    def strings(value):
        if isinstance(value, str):
            yield value
        for item in (
            value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        ):
            yield from strings(item)

    return ["\n".join(strings(row)) for row in _rows(part)]


def _atomic_dir(final: Path, build) -> Path:
    """Run `build(tmp_dir)` and rename the result to `final`, unless another job got there first."""
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    try:
        build(tmp)
        os.replace(tmp, final)
    except OSError:
        if not final.exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def get_tokenizer(
    name_or_path: str | None, raw: datasets.DatasetDict, vocab_size: int, cache_dir: str
):
    """Load `name_or_path` with `AutoTokenizer`, or train a byte-level BPE on `raw['train']`.

    The trained tokenizer is deterministic for a given corpus and vocabulary (`tokenizers` BPE
    breaks ties by pair order), saved as `tokenizer.json` and loadable by `AutoTokenizer`. Its
    single special token `<|endoftext|>` serves as bos, eos, pad and unk; its chat template is
    `data/chat_template.jinja`, in plain text, so that a model trained with it can be fine-tuned
    on conversations (recipes/sft.py).

    Returns:
        A `PreTrainedTokenizerFast` with `eos_token_id` set.
    """
    if name_or_path:
        tok = AutoTokenizer.from_pretrained(name_or_path)
        if tok.eos_token_id is None:
            raise Stop(f"--tokenizer_name_or_path {name_or_path}: tokenizer has no eos token")
        return tok
    digest = _text_digest(raw["train"])[:16]

    def build(tmp: Path):
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(
            raw["train"]["text"],
            vocab_size=vocab_size,
            min_frequency=2,
            special_tokens=[EOS],
            show_progress=False,
        )
        tok = PreTrainedTokenizerFast(
            tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS
        )
        tok.save_pretrained(tmp)

    path = _atomic_dir(Path(cache_dir) / f"tokenizer-bpe{vocab_size}-{digest}", build)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = (REPO_ROOT / "data" / "chat_template.jinja").read_text()
    return tok


MIN_TOKENIZER_ENTRIES = (
    256  # a byte-level BPE starts with 256 bytes; no working tokenizer has fewer
)
TOKENIZER_SAMPLE_CHARS = 20_000  # what `tokenizer_error` encodes
MAX_CHARS_PER_TOKEN = (
    50  # English BPEs give 3-5 characters per token, byte-level ones never above 1 token per byte
)


def tokenizer_error(tokenizer, source: str, texts: list[str]) -> str | None:
    """Why `tokenizer` cannot be the one to train on `texts`, or None when it looks usable.

    Catches a tokenizer that loads but does not work: e.g. `AutoTokenizer.from_pretrained` of a
    model directory without tokenizer files, which transformers 5.24 answers with an empty
    tokenizer (one entry, every text encodes to no tokens), so that every row became a lone
    end-of-text token and the run "learned" fast. Two tests on the first `TOKENIZER_SAMPLE_CHARS`
    characters of `texts`: fewer than `MIN_TOKENIZER_ENTRIES` entries, or fewer than one token
    per `MAX_CHARS_PER_TOKEN` characters.

    Args:
        tokenizer: the loaded tokenizer.
        source: where it came from (a directory or hub name), named in the message.
        texts: training documents.

    Returns:
        One line naming `source` and both figures and saying to pass --tokenizer_name_or_path, or None.
    """
    sample, n = [], 0
    for text in texts:
        sample.append(text[: TOKENIZER_SAMPLE_CHARS - n])
        n += len(sample[-1])
        if n >= TOKENIZER_SAMPLE_CHARS:
            break
    n_tokens = sum(len(ids) for ids in tokenizer(sample, add_special_tokens=False)["input_ids"])
    if len(tokenizer) < MIN_TOKENIZER_ENTRIES or n_tokens * MAX_CHARS_PER_TOKEN < n:
        return (
            f"the tokenizer loaded from {source} has {len(tokenizer)} entries and encodes {n:,} characters of "
            f"the training text into {n_tokens:,} tokens (a working one has at least {MIN_TOKENIZER_ENTRIES} and "
            f"1 token per {MAX_CHARS_PER_TOKEN} characters; a model directory without tokenizer files gives an "
            "empty one): pass --tokenizer_name_or_path with the tokenizer's directory or name"
        )
    return None


PACKING = ("stream", "documents", "none")  # --packing; `PACKING_ALIASES` keeps true/false working
PACKING_ALIASES = {"true": "stream", "false": "none"}


def packing_digest(
    raw: datasets.DatasetDict,
    tokenizer,
    block_size: int,
    packing: str = "stream",
    rows_key: str | None = None,
) -> str:
    """16 hex digits of SHA-256 over the train and validation rows, the tokenizer, `block_size`,
    `packing` (one of `PACKING`) and `rows_key` (what a recipe's own `to_rows` does: its template,
    its label rule): what decides the blocks `pack_dataset` makes (its cache key; the
    version tag changes whenever the packing does, so no older cache is reused). Equal on two ranks
    means the same training and validation blocks; compare it across nodes, which each read
    their own copy of the data."""
    key = json.dumps(
        [
            "v4",
            _text_digest(raw["train"], raw["validation"]),
            tokenizer.backend_tokenizer.to_str(),
            block_size,
            packing,
        ]
        + ([rows_key] if rows_key else [])
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer's own template puts before a text (e.g. Llama 3's `<|begin_of_text|>`),
    without the eos: where bos is eos, the eos after the previous document already separates it.
    Whatever the template puts after a text (an eos, for some) is left to `document_ids`."""
    probe = "a"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    start = next(
        (i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0
    )
    return [t for t in full[:start] if t != tokenizer.eos_token_id]


def document_ids(tokenizer, texts: list[str]) -> tuple[list[list[int]], dict[str, int]]:
    """Each text as one document: the tokenizer's own prefix (`special_prefix`), the text's tokens,
    and exactly one eos, which is the only separator between documents (a tokenizer that appends an
    eos itself, or whose bos is its eos, gives no `eos eos`).

    Special-token strings written in the text (`<|endoftext|>`, `<|im_start|>`, ...) are encoded
    as the plain text they are (`split_special_tokens`), never as control tokens: an eos in the
    middle of a document would otherwise be trained on as a document end.

    Returns:
        (the ids of each text, {special-token string: its occurrences in `texts`} for those found).
    """
    specials = sorted(
        {
            *tokenizer.all_special_tokens,
            *(t.content for t in tokenizer.added_tokens_decoder.values() if t.special),
        },
        key=len,
    )
    pattern = re.compile("|".join(re.escape(t) for t in reversed(specials))) if specials else None
    found: dict[str, int] = {}
    for text in texts if pattern else []:
        for match in pattern.finditer(text):
            found[match.group()] = found.get(match.group(), 0) + 1
    prefix, eos = special_prefix(tokenizer), tokenizer.eos_token_id
    ids = tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return [prefix + row + [eos] for row in ids], found


def pack_blocks(
    tokens: datasets.Dataset,
    block_size: int,
    cache_file: Path,
    fingerprint: str,
    documents: bool = False,
) -> tuple[datasets.Dataset, dict]:
    """Concatenate the `ids` rows of `tokens`, in order, and cut the stream into `block_size` blocks.

    Blocks span rows and batches alike: only the stream's last partial block (fewer than
    `block_size` tokens) is dropped. Block k is tokens [k * block_size, (k + 1) * block_size) of
    the stream, so each batch of the map reads its own slice (no state carried between batches)
    and the result is the same however it is batched. Arrow's flattened view of the rows is not
    a copy, and the blocks are written to `cache_file`, so memory stays bounded when `tokens` is
    on disk.

    Args:
        tokens: one row per document, column `ids` (token ids, eos included) and, if a recipe made
            its own, `labels` (-100 where a token is no target; else the labels are the ids).
        cache_file: where the blocks are written (an `.arrow` file in a scratch directory).
        fingerprint: the result's `datasets` fingerprint (hashing the stream would read it all).
        documents: also `position_ids`, 0 at each row's first token and at each block's first token
            (a row a block cut splits goes on in the next block from 0), and label -100 wherever the
            position is 0: no token is a target predicted from another row.

    Returns:
        (blocks, stats): `input_ids` and `labels` (documents: and `position_ids`), int64 lists of
        `block_size`; stats `{"rows", "tokens", "blocks", "dropped_tokens"}` (dropped: below
        `block_size`), documents: and `"split_documents"` (rows a block cut splits).
    """
    import numpy as np
    import pyarrow.compute as pc

    if tokens._indices is not None:  # a select()ed view: its table holds other rows too
        tokens = tokens.flatten_indices()
    stream = pc.list_flatten(tokens.data.column("ids"))  # a view: no copy of the tokens
    own = pc.list_flatten(tokens.data.column("labels")) if "labels" in tokens.column_names else None
    n_blocks = len(stream) // block_size
    lengths = pc.list_value_length(tokens.data.column("ids")).to_numpy()
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(
        np.int64
    )  # each row's first token
    columns = ("input_ids", "labels", "position_ids") if documents else ("input_ids", "labels")

    def cut(batch):
        first, count = batch["block"][0], len(batch["block"])  # consecutive block numbers
        ids = stream.slice(first * block_size, count * block_size).to_numpy().astype(np.int64)
        blocks = ids.reshape(count, block_size)
        labels = (
            blocks
            if own is None
            else own.slice(first * block_size, count * block_size)
            .to_numpy()
            .astype(np.int64)
            .reshape(count, block_size)
        )
        if not documents:
            return {"input_ids": blocks, "labels": labels}
        at = np.arange(first * block_size, (first + count) * block_size, dtype=np.int64)
        row_start = starts[np.searchsorted(starts, at, side="right") - 1]
        positions = (at - np.maximum(row_start, at // block_size * block_size)).reshape(
            count, block_size
        )
        return {
            "input_ids": blocks,
            "labels": np.where(positions == 0, -100, labels),
            "position_ids": positions,
        }

    index = datasets.Dataset.from_dict({"block": np.arange(n_blocks, dtype=np.int64)})
    blocks = index.map(
        cut,
        batched=True,
        batch_size=1000,
        remove_columns=["block"],
        new_fingerprint=fingerprint,
        cache_file_name=str(cache_file),
        features=datasets.Features({k: datasets.List(datasets.Value("int64")) for k in columns}),
    )
    stats = {
        "rows": len(tokens),
        "tokens": len(stream),
        "blocks": n_blocks,
        "dropped_tokens": len(stream) - n_blocks * block_size,
    }
    if documents:  # rows that start in a kept block and end in a later one
        ends = starts + lengths
        split = (starts // block_size < (ends - 1) // block_size) & (starts < n_blocks * block_size)
        stats["split_documents"] = int(split.sum())
    return blocks, stats


def chat_rows(tokenizer, template_file: str | None, assistant_only: bool):
    """`pack_dataset`'s `to_rows` and `rows_key`: each conversation through the chat template
    (`template_file`'s, else the tokenizer's), as token ids and labels (-100 but on the assistant's
    turns, with assistant_only). A turn's tokens are what the template adds for it: the
    assistant's are those after the generation prompt (its header)."""
    if template_file:
        if not Path(template_file).is_file():
            raise Stop(f"--chat_template {template_file}: no such file")
        tokenizer.chat_template = Path(template_file).read_text()
    if not tokenizer.chat_template:
        raise Stop(
            "the tokenizer has no chat template: pass --chat_template FILE (a Jinja "
            "template; data/chat_template.jinja is a plain-text one)"
        )

    def render(messages, prompt=False) -> list[int]:
        return list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=prompt, tokenize=True, return_dict=False
            )
        )

    def to_rows(batch: dict) -> dict:
        rows = {"ids": [], "labels": []}
        for messages in batch.get("messages") or [
            [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
            for p, c in zip(batch["prompt"], batch["completion"])
        ]:
            ids = render(messages)
            labels = [-100] * len(ids) if assistant_only else list(ids)
            for k, turn in enumerate(messages if assistant_only else []):
                if turn["role"] != "assistant":
                    continue
                which = f"the conversation that starts {messages[0]['content'][:40]!r}"
                if k == 0:
                    raise Stop(f"{which} starts with an assistant turn: it answers nothing")
                prompt, whole = render(messages[:k], prompt=True), render(messages[: k + 1])
                if ids[: len(whole)] != whole or whole[: len(prompt)] != prompt:
                    raise Stop(
                        f"the chat template is not prefix-stable: in {which}, "
                        f"turn {k} changes the tokens before it"
                    )
                start, end = len(prompt), len(whole)
                labels[start:end] = ids[start:end]  # the reply and what closes it (the eos)
            rows["ids"].append(ids)
            rows["labels"].append(labels)
        return rows

    return to_rows, json.dumps([tokenizer.chat_template, assistant_only])


def pack_stats(lm_data: datasets.DatasetDict) -> dict:
    """What `pack_dataset` kept of each split, read from its cache: packed, `{split: {"rows", "tokens",
    "blocks", "dropped_tokens", "special_text"}}` (documents: and "split_documents"); padded, `{split: {"rows",
    "cut_rows", "cut_tokens", "special_text"}}`; {} if unknown. `special_text`: special-token strings
    found in the text (encoded as text, `document_ids`) and how often."""
    files = lm_data["train"].cache_files
    if not files:
        return {}
    root = Path(files[0]["filename"]).parent.parent  # <cache>/train/data-*.arrow
    for name in ("packing.json", "truncation.json"):
        if (root / name).is_file():
            return json.loads((root / name).read_text())
    return {}


def pack_dataset(
    raw: datasets.DatasetDict,
    tokenizer,
    block_size: int,
    cache_dir: str,
    packing: str = "stream",
    to_rows=None,
    rows_key: str | None = None,
    length_flag: str = "--block_size",
) -> datasets.DatasetDict:
    """Tokenize every row into one document (`document_ids`: one eos at its end; or a recipe's own
    `to_rows`) and make fixed `block_size`-token training examples, as `packing` says (one of
    `PACKING`):

    - "stream" (pretraining; run_clm's grouping): concatenate all rows of a split, in order, and
      cut the stream into blocks (`pack_blocks`); every token attends to every earlier token of
      its block, across documents, with positions running on.
    - "documents" (fine-tuning on short documents): the same blocks, plus `position_ids` that
      restart at 0 at each document (and each block), from which transformers' mask builder makes
      attention block-diagonal: no token attends across a document boundary, and each document's
      first token is no target (label -100), as in that document alone.
    - "none": one example per row, truncated to `block_size` and right-padded with the pad
      token; padded positions get label -100 and attention_mask 0, so they carry no loss; rows
      longer than a block lose their tail, and a warning (rank 0) says how many rows and tokens
      were cut.

    Packed, only a split's last partial block is dropped (`pack_stats` says how many tokens), and
    rows with no text are left out (they would put `eos eos` in the stream). Special-token strings
    in the text are encoded as text, and a warning (rank 0) counts them. Cached on disk by
    `packing_digest`.

    A recipe's data stage makes its own documents and labels with `to_rows(batch) -> {"ids": [...],
    "labels": [...]}` (a `datasets` batch of raw rows in; one document per row out, labels -100
    where a token is no target, e.g. all but a chat's assistant turns), named by `rows_key` (what
    it does: template, label rule), which joins the cache key and the data digest
    (`packing_digest`); the packing, the cache and the statistics are the same, but for "stream",
    refused: its loss count (llama.py's) takes every position of a block as a target.
    `length_flag` is the flag the warnings name.

    Returns:
        `DatasetDict` (`train`, `validation`) with `input_ids`, `labels` (documents: and
        `position_ids`; none: and `attention_mask`): int64 lists of length `block_size`. Labels
        are not shifted: the model shifts them.

    Raises:
        Stop: packed, a split holds fewer tokens than one block (states both numbers).
    """
    if packing not in PACKING:
        raise Stop(f"--packing {packing}: choose one of {', '.join(PACKING)}")
    if to_rows is not None and packing == "stream":  # (llama.py's loss count assumes it)
        raise Stop(
            "--packing stream trains on every token of a block: a recipe's own labels need "
            "--packing documents or none"
        )
    digest = packing_digest(raw, tokenizer, block_size, packing, rows_key)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos

    def tokenize(batch):
        if to_rows is not None:  # the recipe's own documents and labels; no empty one
            rows = to_rows(batch)
            keep = [i for i, ids in enumerate(rows["ids"]) if ids]
            return {
                "ids": [rows["ids"][i] for i in keep],
                "labels": [rows["labels"][i] for i in keep],
                "found": [""] * len(keep),
            }
        ids, found = document_ids(tokenizer, batch["text"])
        if packing != "none":  # an empty row would add a second separator
            ids = [row for row, text in zip(ids, batch["text"]) if text]
        return {"ids": ids, "found": [json.dumps(found)] + [""] * (len(ids) - 1) if ids else []}

    def pad_rows(batch):
        rows = [ids[:block_size] for ids in batch["ids"]]
        labels = [r[:block_size] for r in batch["labels"]] if "labels" in batch else rows
        fill = [block_size - len(r) for r in rows]
        return {
            "input_ids": [r + [pad] * k for r, k in zip(rows, fill)],
            "labels": [r + [-100] * k for r, k in zip(labels, fill)],
            "attention_mask": [[1] * len(r) + [0] * k for r, k in zip(rows, fill)],
        }

    def special_text(split_tokens) -> dict[str, int]:
        total: dict[str, int] = {}
        for found in filter(None, split_tokens["found"]):
            for text, n in json.loads(found).items():
                total[text] = total.get(text, 0) + n
        return total

    def build(tmp: Path):
        tokens = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)
        found = {split: special_text(tokens[split]) for split in tokens}
        tokens = tokens.remove_columns("found")
        if packing == "none":
            tokens.map(
                pad_rows, batched=True, remove_columns=tokens["train"].column_names
            ).save_to_disk(str(tmp))
            lengths = {split: [len(ids) for ids in tokens[split]["ids"]] for split in tokens}
            cut = {
                split: {
                    "rows": len(n),
                    "cut_rows": sum(k > block_size for k in n),
                    "cut_tokens": sum(max(k - block_size, 0) for k in n),
                    "special_text": found[split],
                }
                for split, n in lengths.items()
            }
            (tmp / "truncation.json").write_text(json.dumps(cut))
            return
        for split in ("train", "validation"):
            n_tokens = sum(len(ids) for ids in tokens[split]["ids"])
            if n_tokens < block_size:
                fix = (
                    f"lower {length_flag}, or add text"
                    if split == "train"
                    else f"lower {length_flag}, raise "
                    "--validation_split_percentage, or pass --validation_file"
                )
                raise Stop(
                    f"{split} split has {n_tokens} tokens, fewer than one block ({length_flag} "
                    f"{block_size}): {fix}"
                )
        with tempfile.TemporaryDirectory(dir=tmp.parent, prefix=f".{tmp.name}.") as scratch:
            packed = {
                split: pack_blocks(
                    tokens[split],
                    block_size,
                    Path(scratch) / f"{split}.arrow",
                    f"{digest}-{split}",
                    documents=packing == "documents",
                )
                for split in ("train", "validation")
            }
            datasets.DatasetDict({s: ds for s, (ds, _) in packed.items()}).save_to_disk(str(tmp))
        (tmp / "packing.json").write_text(
            json.dumps({s: {**stats, "special_text": found[s]} for s, (_, stats) in packed.items()})
        )

    path = _atomic_dir(Path(cache_dir) / f"{packing}-{block_size}-{digest}", build)
    stats = json.loads(
        next(p for p in (path / "packing.json", path / "truncation.json") if p.exists()).read_text()
    )
    log = get_logger(__name__)
    for split, c in stats.items():
        if c.get("special_text"):
            counts = ", ".join(f"{text} x {n}" for text, n in sorted(c["special_text"].items()))
            log.warning(
                f"the {split} text contains special-token strings ({counts}): encoded as the plain "
                "text they are, not as control tokens; the only control token the recipe adds is one "
                "eos after each document",
                main_process_only=True,
            )
        if packing == "none" and c["cut_rows"]:
            log.warning(
                f"--packing none: {c['cut_rows']} of {c['rows']} {split} rows are longer than {length_flag} "
                f"{block_size} and lose their tail ({c['cut_tokens']} tokens never "
                f"{'trained on' if split == 'train' else 'evaluated'}); raise "
                f"{length_flag} or pack them (--packing documents)",
                main_process_only=True,
            )
    return datasets.load_from_disk(str(path))


def train_and_eval_sets(
    lm_data: datasets.DatasetDict, max_eval_samples: int | None, sample_ids: bool = False
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """`pack_dataset`'s training and validation sets: the validation set cut to its first
    `max_eval_samples` blocks (None: all of them); with `sample_ids`, the training set gains a
    "sample_id" column, each block's index in it (--record_sample_ids: the data order check)."""
    train_set, eval_set = lm_data["train"], lm_data["validation"]
    if sample_ids:
        train_set = train_set.add_column("sample_id", list(range(len(train_set))))
    if max_eval_samples:
        eval_set = eval_set.select(range(min(max_eval_samples, len(eval_set))))
    return train_set, eval_set
