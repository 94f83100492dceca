"""Build the bundled chat set `data/chat/{train,validation}.jsonl` from the bundled Shakespeare corpus.

Offline and deterministic (no randomness, no network): the same corpus gives byte-identical files.
Run from anywhere:  python data/make_chat.py   (prints the counts and the SHA-256 of both outputs)

Source: the plays of `data/shakespeare/*.txt.gz`, read and checked against `SHA256SUMS` by
`common.data.load_shakespeare` (the poems and sonnets have no dialogue and are skipped).

Rule:
1. A play is cut into blocks at blank lines. A block is a *speech* when its first line is a
   speaker header (`HAMLET.`, `First Lord.`, `Ham.`, or `THESEUS` in capitals without the period,
   as A Midsummer Night's Dream writes it) followed by text; stage directions in [brackets] are
   removed from the text, lines are stripped and kept, so verse keeps its line breaks.
2. Any other block (act or scene heading, stage direction, a speech going on after a stage
   direction) ends a *run*: only speeches that follow one another directly are paired.
3. Each run is cut greedily, from its start, into conversations of k exchanges (k cycles
   1, 2, 3 over the conversations made, falling back to fewer when the run cannot give k):
   2k consecutive speeches alternating between two speakers. The first speaker is the `user`,
   the second the `assistant`; every fourth conversation starts with a system message naming
   the assistant's character and the play. Size limits: each speech at most `MAX_TURN_CHARS`
   characters, and the messages' characters plus `TURN_CHARS` per message (the template's
   headers) at most `MAX_CONV_CHARS`: under about 300 tokens of the bundled 4,096-token BPE
   with `data/chat_template.jinja` (about 0.3 token per character, 12 per header).
4. Validation: the plays in `VALIDATION_WORKS`, the two works that `load_text_dataset` holds out
   of pretraining by default (its first 5% of rows), so `recipes/llama.py` never trained on
   them. Train: every other play. Each split keeps `N_TRAIN` / `N_VALIDATION` conversations,
   evenly spaced over the split's conversations in corpus order (every play contributes).

Sizes: 4,000 train and 400 validation conversations (of the 9,406 and 688 the rule gives), one
JSON object `{"messages": [...]}` per line, 1.4 MB and 0.14 MB; 78% one exchange, 18% two, 4% three;
a quarter with a system message. 25 to 261 tokens each (median 93) with the bundled BPE and
`data/chat_template.jinja`, 35% of them assistant targets (content + eos).
Output of the last run (python 3.11, from the corpus checked by `SHA256SUMS`):
    train: ... sha256 d8e3faa6602b0a5556000a269d2f5177580d62cd4612030ee5117ce8664cd49f
    validation: ... sha256 2742f8e889a788a48798773bc7cd20eff71466b8815f1aacd8a4fe45fbf1f7b0
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from common.data import load_shakespeare  # noqa: E402

OUT_DIR = REPO_ROOT / "data" / "chat"
VALIDATION_WORKS = ("alls_well_that_ends_well", "antony_and_cleopatra")
NOT_PLAYS = (
    "lovers_complaint",
    "passionate_pilgrim",
    "phoenix_and_the_turtle",
    "rape_of_lucrece",
    "sonnets",
)
N_TRAIN, N_VALIDATION = 4000, 400
MAX_TURN_CHARS, MAX_CONV_CHARS, TURN_CHARS = 400, 800, 40
SYSTEM_EVERY = 4

HEADER = re.compile(
    r"[A-Z][A-Za-z'&\- ]{0,35}\.|[A-Z][A-Z'&\- ]{1,35}"
)  # matched against the whole line
NOT_SPEAKERS = re.compile(
    r"(ACT|Act|SCENE|Scene|SONG|EPILOGUE|PROLOGUE)\b|[IVXLC]+\.?$"
)  # headings, stanza numbers
SMALL_WORDS = {"and", "of", "the", "or", "that", "in", "a"}
ROMAN = {"II", "III", "IV", "V", "VI", "VIII"}


def title_case(text: str) -> str:
    """'THE TRAGEDY OF KING RICHARD THE SECOND' -> 'The Tragedy of King Richard the Second'."""
    words = text.split()
    return " ".join(
        w
        if w.rstrip(",;") in ROMAN
        else w.lower()
        if i and w.lower() in SMALL_WORDS
        else w[0] + w[1:].lower()
        for i, w in enumerate(words)
    )


def runs(text: str) -> list[list[tuple[str, str]]]:
    """The play's runs of directly consecutive speeches, each speech (speaker, text)."""
    found, run = [], []
    for block in re.split(r"\n[ \t]*\n", text):
        lines = [line.strip() for line in block.strip("\n").split("\n")]
        body = re.sub(
            r"\[[^\]]*\]", "", "\n".join(lines[1:])
        )  # stage directions, also over several lines
        header, body = (
            lines[0],
            re.sub(r"\[[^\n]*|\]", "", body),
        )  # and one left open to the line's end
        body = "\n".join(line.strip() for line in body.split("\n") if line.strip())
        if (
            HEADER.fullmatch(header)
            and not NOT_SPEAKERS.match(header)
            and re.search(r"[a-z]", body)
        ):
            run.append((title_case(header.rstrip(".")), body))
        else:
            found, run = found + [run] if run else found, []
    return found + [run] if run else found


def conversations(
    speeches: list[tuple[str, str]], title: str, counter: list[int]
) -> list[list[dict]]:
    """Cut one run into conversations (rule 3); `counter` ([conversations made so far]) is shared by all runs."""
    made, i = [], 0
    while i < len(speeches):
        for k in range(counter[0] % 3 + 1, 0, -1):
            window = speeches[i : i + 2 * k]
            speakers = [s for s, _ in window]
            if (
                len(window) < 2 * k
                or speakers[0] == speakers[1]
                or speakers != speakers[:2] * k
                or max(len(t) for _, t in window) > MAX_TURN_CHARS
            ):
                continue
            messages = [
                {"role": ("user", "assistant")[j % 2], "content": t}
                for j, (_, t) in enumerate(window)
            ]
            if counter[0] % SYSTEM_EVERY == 0:
                system = f"You are {speakers[1]}, in {title}. Answer in character."
                messages.insert(0, {"role": "system", "content": system})
            if sum(len(m["content"]) + TURN_CHARS for m in messages) <= MAX_CONV_CHARS:
                made.append(messages)
                counter[0] += 1
                i += 2 * k
                break
        else:
            i += 1
    return made


def evenly(items: list, n: int) -> list:
    """`n` items evenly spaced over `items`, in order (all of them when there are fewer)."""
    return items if len(items) <= n else [items[i * len(items) // n] for i in range(n)]


def main() -> None:
    corpus = load_shakespeare()
    splits: dict[str, list] = {"train": [], "validation": []}
    counter = [0]
    for text, work in zip(corpus["text"], corpus["work"]):
        if work in NOT_PLAYS:
            continue
        title = title_case(text.strip().split("\n")[0])
        split = "validation" if work in VALIDATION_WORKS else "train"
        for run in runs(text):
            splits[split] += conversations(run, title, counter)
    OUT_DIR.mkdir(exist_ok=True)
    for split, n in (("train", N_TRAIN), ("validation", N_VALIDATION)):
        rows = evenly(splits[split], n)
        data = "".join(
            json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in rows
        ).encode()
        (OUT_DIR / f"{split}.jsonl").write_bytes(data)
        exchanges = [sum(t["role"] == "assistant" for t in m) for m in rows]
        print(
            f"{split}: {len(rows)} of {len(splits[split])} conversations, exchanges "
            f"{ {k: exchanges.count(k) for k in (1, 2, 3)} }, "
            f"{sum(m[0]['role'] == 'system' for m in rows)} with a system message, {len(data):,} bytes, "
            f"sha256 {hashlib.sha256(data).hexdigest()}  data/chat/{split}.jsonl"
        )


if __name__ == "__main__":
    main()
