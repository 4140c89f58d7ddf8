"""One work unit of a store's input -> a part: its documents tokenized, masked and cut to fit, written (staged,
renamed) under the work directory of hfscale.data.store.prepare, for hfscale.data.merge to join.

A part directory holds, per split: {split}.tok (the tokens, the store's dtype, end to end), {split}.len.npy (int64
document lengths), {split}.span.npy (int64 [S, 2] trained runs, offsets within the part), and stats.json (format,
source, file, resolved options, example counts). Memory holds one unit (<= 32 MiB of input).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..util.errors import HfscaleError
from . import formats, sources as src_mod
from .store import SPLITS, DataOptions

BATCH = 256  # text records tokenized per call: the fast tokenizer's batch path


def _heldout(record: dict, frac: float) -> bool:
    """Held out by content (xxh3 of the record): the same example lands on the same side wherever it sits."""
    import xxhash

    return frac > 0 and xxhash.xxh3_64_intdigest(json.dumps(record, sort_keys=True, default=str).encode()) % 1_000_000 < frac * 1e6


def write_part(part: Path, unit, split: str, tok, opts: DataOptions, hold_out: bool, vocab: int,
                store_packing: str | None = None) -> None:
    from ..util.atomic import staged

    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    acc = {s: _Acc() for s in SPLITS}
    fmt = None
    pending: list = []

    def flush():
        if not pending:
            return
        texts = [r["text"] for _, r, _ in pending]
        if all(isinstance(t, str) for t in texts):
            bodies = tok.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
            encs = [formats.Encoded(formats._wrap(tok, b), [1] * (len(b) + (tok.bos is not None) + (tok.eos is not None)))
                    for b in bodies]
        else:
            encs = [formats.encode(r, "text", tok, "all", w) for w, r, _ in pending]
        for (w, _, s), enc in zip(pending, encs):
            acc[s].add(enc, opts, resolved, w, tok)
        pending.clear()

    resolved = None
    for where, rec in src_mod.records(unit):
        got = opts.format or formats.detect(rec.keys(), where)
        if fmt is None:
            fmt, first = got, where
            resolved = opts.resolved(fmt, store_packing)
            if fmt in ("messages",) or (fmt == "prompt_completion" and isinstance(rec.get("prompt"), list)):
                if not tok.has_template:
                    formats.encode(rec, fmt, tok, resolved["train_on"], where)  # raises the one-line refusal
        elif got != fmt:
            raise HfscaleError(f"{where} holds {got} data but {first} holds {fmt}: one format per input; "
                               "split the file or set format:")
        s = "validation" if split == "validation" or (hold_out and _heldout(rec, opts.heldout)) else "train"
        if fmt == "text" and resolved["train_on"] == "all":
            pending.append((where, rec, s))
            if len(pending) >= BATCH:
                flush()
        else:
            acc[s].add(formats.encode(rec, fmt, tok, resolved["train_on"], where), opts, resolved, where, tok)
    flush()
    with staged(part, directory=True) as stage:
        for s, a in acc.items():
            a.write(stage, s, dtype)
        (stage / "stats.json").write_text(json.dumps({"format": fmt, "source": unit.source, "file": unit.file,
                                                      "resolved": resolved, "splits": {s: a.stats for s, a in acc.items()}}))


class _Acc:
    """One part's documents of one split, in memory (bounded by a unit)."""

    def __init__(self):
        self.ids: list = []
        self.lens: list = []
        self.spans: list = []
        self.n = 0
        self.stats = {"examples": 0, "truncated": 0, "dropped": 0, "split": 0}

    def add(self, enc, opts, resolved, where, tok) -> None:
        formats.check_example(enc, tok, where)
        self.stats["examples"] += 1
        L, ids, mask = resolved["seq_len"], enc.ids, enc.mask
        pieces = [(ids, mask)]
        if len(ids) > L and resolved["packing"] != "wrapped":
            how = resolved["overflow"]
            self.stats[{"truncate": "truncated", "drop": "dropped", "split": "split"}[how]] += 1
            if how == "drop":
                return
            if how == "truncate":
                pieces = [(ids[:L], mask[:L])]
            else:
                pieces = [(ids[a:a + L], mask[a:a + L]) for a in range(0, len(ids), L) if len(ids) - a >= 2]
        kept = [(i, m) for i, m in pieces if any(m[1:])]  # a piece whose only label would be its first token trains nothing
        if not kept:
            self.stats["dropped"] += 1 if resolved["overflow"] != "drop" else 0
            return
        for i, m in kept:
            self.ids.append(np.asarray(i, dtype=np.int64))
            self.lens.append(len(i))
            m = np.asarray(m, dtype=np.int8)
            edges = np.flatnonzero(np.diff(np.concatenate([[0], m, [0]])))
            self.spans.append(edges.reshape(-1, 2) + self.n)
            self.n += len(i)

    def write(self, stage: Path, split: str, dtype) -> None:
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, dtype=np.int64)
        with open(stage / f"{split}.tok", "wb") as f:
            f.write(ids.astype(dtype).tobytes())
        save(stage / f"{split}.len.npy", np.asarray(self.lens, dtype=np.int64))
        save(stage / f"{split}.span.npy", np.concatenate(self.spans) if self.spans else np.zeros((0, 2), np.int64))


class _Plain:
    """A file as numpy sees a non-file object: np.save then writes through .write, whose OSError keeps its errno
    (ndarray.tofile raises a bare OSError on a full disk)."""

    def __init__(self, f):
        self.write = f.write


def save(path: Path, arr) -> None:
    with open(path, "wb") as f:
        np.save(_Plain(f), arr)
