"""Documents -> rows of at most seq_len tokens, over the whole dataset, offline and deterministic.

A packing is a table of segments (document, start within it, length), int32 [N, 3], and row pointers
int64 [R + 1] (row r holds segments row_ptr[r]:row_ptr[r+1]). Documents in a row never attend to each
other: the collator restarts position ids at every segment and the attention kernels take the boundaries
from there (hfscale.data.dataset).

PACKING:
- `bfd`: best-fit decreasing. Documents longest first (ties by index), each into the open row whose free
  space is the smallest that still fits it, else a new row. Needs every document <= seq_len (overflow
  truncate / drop / split before). Free space per row lives in buckets by size: finding the best fit is one
  vectorised scan of seq_len + 1 counters, so a million documents pack in seconds.
- `wrapped`: documents concatenated in order and cut every seq_len tokens (pre-training style); a document
  cut by a row boundary continues as its own segment in the next row; the last partial row is dropped.
- `none`: one document per row (padded by the collator).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..util.errors import ConfigError

PACKING = {
    "bfd": "best-fit decreasing over the whole dataset (chat / prompt-completion default)",
    "wrapped": "concatenate and cut every seq_len tokens (text default)",
    "none": "one example per row, padded",
}


@dataclass(frozen=True)
class Packed:
    segments: np.ndarray  # int32 [N, 3]: doc, start, length
    row_ptr: np.ndarray  # int64 [R + 1]
    seq_len: int

    @property
    def rows(self) -> int:
        return len(self.row_ptr) - 1

    @property
    def tokens(self) -> int:
        return int(self.segments[:, 2].sum()) if len(self.segments) else 0

    @property
    def efficiency(self) -> float:
        """Real tokens / token slots (rows x seq_len)."""
        return self.tokens / (self.rows * self.seq_len) if self.rows else 0.0


def pack(lengths: np.ndarray, seq_len: int, how: str, order: np.ndarray | None = None) -> Packed:
    """Pack documents of `lengths` (indexed by document), visiting `order` (default all in index order; a
    mixture repeats documents there)."""
    if how not in PACKING:
        raise ConfigError(f"packing {how!r} not understood; use one of {', '.join(PACKING)}")
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.arange(len(lengths), dtype=np.int64) if order is None else np.asarray(order, dtype=np.int64)
    return {"bfd": _bfd, "wrapped": _wrapped, "none": _none}[how](lengths, order, seq_len)


def _none(lengths, order, seq_len) -> Packed:
    if len(order) and lengths[order].max() > seq_len:
        raise ConfigError(f"a document of {int(lengths[order].max())} tokens does not fit a row of {seq_len}")
    seg = np.stack([order, np.zeros_like(order), lengths[order]], axis=1).astype(np.int32)
    return Packed(seg.reshape(-1, 3), np.arange(len(order) + 1, dtype=np.int64), seq_len)


def _wrapped(lengths, order, seq_len) -> Packed:
    lens = lengths[order]
    starts = np.concatenate([[0], np.cumsum(lens)])
    rows = int(starts[-1] // seq_len)
    end = rows * seq_len
    cuts = np.union1d(starts[:-1][starts[:-1] < end], np.arange(0, end, seq_len, dtype=np.int64))
    piece_end = np.append(cuts[1:], end)
    which = np.searchsorted(starts, cuts, side="right") - 1
    seg = np.stack([order[which], cuts - starts[which], piece_end - cuts], axis=1).astype(np.int32)
    row_ptr = np.searchsorted(cuts, np.arange(0, end + 1, seq_len, dtype=np.int64)).astype(np.int64)
    return Packed(seg.reshape(-1, 3), row_ptr, seq_len)


def _bfd(lengths, order, seq_len) -> Packed:
    lens = lengths[order]
    if len(lens) and lens.max() > seq_len:
        raise ConfigError(f"a document of {int(lens.max())} tokens does not fit a row of {seq_len}: bfd needs "
                          "overflow truncate, drop or split")
    visit = np.lexsort((np.arange(len(lens)), -lens))  # longest first, ties by position: deterministic
    count = np.zeros(seq_len + 1, dtype=np.int64)  # open rows by free space
    bucket: list[list[int]] = [[] for _ in range(seq_len + 1)]
    free: list[int] = []
    row_of = np.empty(len(lens), dtype=np.int64)
    for i in visit.tolist():
        need = int(lens[i])
        hit = np.flatnonzero(count[need:])
        if len(hit):
            space = need + int(hit[0])
            r = bucket[space].pop()
            count[space] -= 1
        else:
            r, space = len(free), seq_len
            free.append(seq_len)
        left = space - need
        free[r] = left
        bucket[left].append(r)
        count[left] += 1
        row_of[i] = r
    by_row = np.lexsort((np.arange(len(lens)), row_of))  # within a row: by position in `order`
    seg = np.stack([order[by_row], np.zeros(len(by_row), dtype=np.int64), lens[by_row]], axis=1).astype(np.int32)
    row_ptr = np.searchsorted(row_of[by_row], np.arange(len(free) + 1)).astype(np.int64)
    return Packed(seg.reshape(-1, 3), row_ptr, seq_len)


def mixture_order(doc_weight: np.ndarray, seed: int = 0) -> np.ndarray:
    """Documents repeated by their source's weight: floor(w) copies, plus one more for a fixed, seeded
    share (w - floor(w)) of them. Weight 1 everywhere: every document once, in order."""
    w = np.asarray(doc_weight, dtype=np.float64)
    if np.all(w == 1.0):
        return np.arange(len(w), dtype=np.int64)
    whole = np.floor(w).astype(np.int64)
    extra = np.random.default_rng(seed).random(len(w)) < (w - whole)
    return np.repeat(np.arange(len(w), dtype=np.int64), whole + extra)
