"""The merge: the parts every rank wrote -> one token store, a chunk at a time (run by rank 0 of
hfscale.data.store.prepare).

The merging rank's memory does not grow with the corpus. Each split is built in three streams:
1. the parts, one at a time (each bounded by its work unit), are appended to tokens.bin, docs.npy and spans.npy;
2. the documents are read back from those files CHUNK at a time (in the mixture's visiting order) and packed:
   wrapped and none cut a chunk into segments with no look at the rest;
3. the segments, row pointers and per-row trained counts are appended to their .npy files (NpyWriter: the header
   holds the row count, so it is rewritten once at the end; numpy reserves room for that).
bfd alone chooses rows over the whole dataset: it holds int32 arrays of one entry per document (the lengths, the
visiting order and the rows while packing; each document's trained count where not every token trains), 4 bytes
each, nothing per token or in int64. Files are written with plain writes, not memory maps, so the pages they fill
are the page cache's, not this process's resident set.

The files are byte for byte what np.save of the whole arrays wrote before (tests/test_data_merge.py).
"""

from __future__ import annotations

import io
import json
import shutil
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..util.errors import HfscaleError
from . import packing
from .store import FAULT_HOOKS, MANIFEST, SPLITS, STORE_VERSION, DataOptions, SourceStats, SplitStats, StoreInfo, open_info

CHUNK = 1 << 16  # documents per step: ~20 MB of temporaries (wrapped cuts a chunk into ~2 segments per document)
COPY = 8 << 20  # bytes of tokens copied at a time


class NpyWriter:
    """An .npy file appended a chunk at a time; what np.save writes for the whole array. The header (it holds the
    row count) is written first with 0 rows and rewritten at close: numpy pads it to a fixed width for exactly this
    (np.lib.format.GROWTH_AXIS_MAX_DIGITS), so its length does not change."""

    def __init__(self, path: Path, dtype, cols: int | None = None):
        self.dtype, self.cols, self.rows = np.dtype(dtype), cols, 0
        self.f = open(path, "wb")
        self.head = len(self._header(0))
        self.f.write(self._header(0))

    def _header(self, rows: int) -> bytes:
        buf = io.BytesIO()
        shape = (rows,) if self.cols is None else (rows, self.cols)
        np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                   "fortran_order": False, "shape": shape})
        return buf.getvalue()

    def write(self, arr) -> None:
        arr = np.ascontiguousarray(arr, dtype=self.dtype)
        if arr.size:
            self.f.write(memoryview(arr).cast("B"))  # a plain write: a full disk raises OSError with its errno
        self.rows += len(arr)

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        try:
            if kind is None:
                head = self._header(self.rows)
                if len(head) != self.head:
                    raise RuntimeError(f"{self.f.name}: the .npy header outgrew its reserved width")
                self.f.seek(0)
                self.f.write(head)
        finally:
            self.f.close()


def npy_rows(path: Path, a: int, b: int) -> np.ndarray:
    """Rows [a, b) of an .npy file, read (not mapped): only they are held."""
    with open(path, "rb") as f:
        shape, _, dtype = _header(f)
        width = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        f.seek(f.tell() + a * width)
        return np.fromfile(f, dtype=dtype, count=(b - a) * width // dtype.itemsize).reshape((b - a, *shape[1:]))


def npy_len(path: Path) -> int:
    with open(path, "rb") as f:
        return _header(f)[0][0]


def _header(f):
    version = np.lib.format.read_magic(f)
    return (np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0)(f)


def merge(work: Path, jobs, sources, out: Path, key: str, opts: DataOptions, vocab: int, log=None,
          store_packing: str | None = None) -> StoreInfo:
    """The parts under `work` (one per job, in job order) -> the store at `out`, staged and renamed."""
    from ..util.atomic import staged
    from ..util.hashing import files_of, hash_file

    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    parts = [work / f"part-{i:06d}" for i in range(len(jobs))]
    stats = [json.loads((p / "stats.json").read_text()) for p in parts]
    seen: dict = {}  # source (or "validation", a held-out file) -> {format: the first file holding it}
    for (_, split), st in zip(jobs, stats):
        if st["format"]:
            seen.setdefault(st["source"] if split == "train" else split, {}).setdefault(st["format"], st["file"])
    for fmts in seen.values():
        if len(fmts) > 1:
            (f1, p1), (f2, p2) = list(fmts.items())[:2]
            raise HfscaleError(f"mixed formats: {p1} holds {f1} data, {p2} holds {f2}; one format per source (give them "
                               "as separate sources of a mixture, 'a.jsonl,b.jsonl', or convert)")
    train_fmts = {s: next(iter(f)) for s, f in seen.items() if s != "validation"}
    if not seen:
        raise HfscaleError("the data holds no examples (empty files?); pass files with at least one record")
    kinds = set(train_fmts.values()) | set(seen.get("validation", {}))
    if len(kinds) == 1:
        resolved = opts.resolved(kinds.pop(), store_packing)
    else:  # each source its own format, train_on and overflow (the parts applied them); one packing
        resolved = {"format": "mixed", "train_on": opts.train_on or "per source", "packing": store_packing,
                    "overflow": opts.overflow or "per source", "seq_len": opts.seq_len}
    per_source = {}
    splits = {}
    with staged(out, directory=True) as stage:
        for split in SPLITS:
            d = stage / split
            d.mkdir()
            weights = [sources[st["source"]].weight if split == "train" else 1.0 for st in stats]
            docs = _append_parts(d, parts, split, [st["source"] for st in stats], weights,
                                 bfd=resolved["packing"] == "bfd")
            rows = _RowWriter(d, docs, len(sources))
            with rows:
                _pack(d, docs, opts.seq_len, resolved["packing"], rows)
                rows.finish()
            if split == "train" and len(sources) > 1:
                per_source = _source_stats(sources, train_fmts, stats, jobs, docs, rows)
            c = {k: sum(st["splits"][split][k] for st in stats) for k in ("examples", "truncated", "dropped", "split")}
            splits[split] = SplitStats(documents=docs.count, tokens=rows.tokens, trained=rows.trained,
                                       rows=rows.rows, efficiency=round(rows.efficiency(opts.seq_len), 6), **c)
            if split == "train" and splits[split].trained == 0:
                raise HfscaleError("no token of the training data is trained (every loss mask is empty after "
                                   f"train_on {resolved['train_on']} and overflow {resolved['overflow']}); check the data's "
                                   "roles / completions, raise seq_len, or use train_on: all")
            if split == "train" and rows.rows == 0:
                raise HfscaleError(f"the training data fills no row of {opts.seq_len} tokens; lower seq_len or add data")
        files = {n: list(hash_file(stage / n)) for n in files_of(stage)}
        manifest = {"version": STORE_VERSION, "key": key, "options": resolved, "given": asdict(opts),
                    "dtype": np.dtype(dtype).name, "vocab": vocab, "all_trained": {},
                    "splits": {k: asdict(v) for k, v in splits.items()}, "files": files,
                    "sources": [asdict(v) for v in per_source.values()]}
        manifest["all_trained"] = {s: not (stage / s / "spans.npy").exists() for s in SPLITS}
        (stage / MANIFEST).write_text(json.dumps(manifest, indent=1))
        for hook in FAULT_HOOKS:
            hook("merge", len(jobs), 0)
    return open_info(out)


@dataclass
class _Docs:
    """One split's documents once the parts are appended: counts, where each part's documents end, and the
    per-document int32 arrays bfd needs (None otherwise)."""
    count: int
    part_end: np.ndarray  # int64 [P]: documents of parts 0..p
    part_source: np.ndarray  # int64 [P]
    part_weight: np.ndarray  # float64 [P]
    all_trained: bool
    span_at: np.ndarray  # int64: spans before document k * CHUNK, and the span count last
    lens: np.ndarray | None = None  # int32 [D] (bfd)
    trained: np.ndarray | None = None  # int32 [D]: tokens with a label per document (bfd, where not all train)

    @property
    def uniform(self) -> bool:
        """Every document visited once, in order (mixture_order's weight-1 case)."""
        has = np.diff(self.part_end, prepend=0) > 0
        return bool(np.all(self.part_weight[has] == 1.0))

    def source_of(self, doc: np.ndarray) -> np.ndarray:
        return self.part_source[np.searchsorted(self.part_end, doc, side="right")]


def _append_parts(d: Path, parts, split: str, part_source, part_weight, bfd: bool) -> _Docs:
    """tokens.bin, docs.npy and spans.npy (absent where every token trains) of one split, a part at a time."""
    counts = [npy_len(p / f"{split}.len.npy") for p in parts]
    all_trained = True
    for p, n in zip(parts, counts):  # every document one trained run, exactly its own (spans hold no empty run)
        if npy_len(p / f"{split}.span.npy") != n:
            all_trained = False
            break
        ln, sp = np.load(p / f"{split}.len.npy"), np.load(p / f"{split}.span.npy")
        ends = np.cumsum(ln)
        if not (np.array_equal(sp[:, 0], ends - ln) and np.array_equal(sp[:, 1], ends)):
            all_trained = False
            break
    total = sum(counts)
    lens = np.empty(total, dtype=np.int32) if bfd else None
    trained = np.empty(total, dtype=np.int32) if bfd and not all_trained else None
    span_at, base, ndocs, nspans = [], 0, 0, 0
    with ExitStack() as stack:
        tokens = stack.enter_context(open(d / "tokens.bin", "wb"))
        docs = stack.enter_context(NpyWriter(d / "docs.npy", np.int64))
        spans = None if all_trained else stack.enter_context(NpyWriter(d / "spans.npy", np.int64, 2))
        docs.write(np.zeros(1, dtype=np.int64))
        for p in parts:
            with open(p / f"{split}.tok", "rb") as g:
                shutil.copyfileobj(g, tokens, COPY)
            ln = np.load(p / f"{split}.len.npy")
            starts = np.cumsum(ln) - ln
            docs.write(base + starts + ln)
            if spans is not None:
                sp = np.load(p / f"{split}.span.npy")
                first = -(-ndocs // CHUNK) * CHUNK  # the chunk boundaries among this part's documents
                span_at += (nspans + np.searchsorted(sp[:, 0], starts[np.arange(first, ndocs + len(ln), CHUNK) - ndocs])).tolist()
                spans.write(sp + base)
                if trained is not None:
                    trained[ndocs:ndocs + len(ln)] = _trained_before(sp, starts + ln) - _trained_before(sp, starts + 1)
                nspans += len(sp)
            if lens is not None:
                lens[ndocs:ndocs + len(ln)] = ln
            base += int(ln.sum())
            ndocs += len(ln)
    return _Docs(total, np.cumsum(counts, dtype=np.int64), np.asarray(part_source, dtype=np.int64),
                 np.asarray(part_weight, dtype=np.float64), all_trained, np.asarray(span_at + [nspans], dtype=np.int64),
                 lens, trained)


def _visits(d: Path, docs: _Docs):
    """The packing's visiting order, CHUNK documents at a time: (doc ids, where each starts in tokens.bin, its
    length, the trained runs of the chunk's documents or None, where the chunk's documents start (one entry
    each, from the chunk's first document on, unrepeated)); a mixture repeats a document in place
    (packing.mixture_order, drawn a chunk at a time from the same generator)."""
    rng = None if docs.uniform else np.random.default_rng(0)
    for k, a in enumerate(range(0, docs.count, CHUNK)):
        b = min(a + CHUNK, docs.count)
        bounds = npy_rows(d / "docs.npy", a, b + 1)
        ids, at, ln = np.arange(a, b, dtype=np.int64), bounds[:-1], np.diff(bounds)
        if rng is not None:
            copies = packing.mixture_copies(docs.part_weight[np.searchsorted(docs.part_end, ids, side="right")], rng)
            ids, at, ln = np.repeat(ids, copies), np.repeat(at, copies), np.repeat(ln, copies)
        runs = None if docs.all_trained else npy_rows(d / "spans.npy", int(docs.span_at[k]), int(docs.span_at[k + 1]))
        yield ids, at, ln, runs, bounds[:-1]


def _pack(d: Path, docs: _Docs, seq_len: int, how: str, rows: "_RowWriter") -> None:
    """Pack one split into `rows`: the same segments and rows as packing.pack over the whole split."""
    from ..util.errors import ConfigError

    if how == "bfd":
        return _pack_bfd(docs, seq_len, rows)
    visited, tokens, longest = 0, 0, 0
    for ids, _, ln, _, _ in _visits(d, docs):
        visited, tokens, longest = visited + len(ids), tokens + int(ln.sum()), max(longest, int(ln.max(initial=0)))
    if how == "none" and longest > seq_len:
        raise ConfigError(f"a document of {longest} tokens does not fit a row of {seq_len}")
    end = tokens // seq_len * seq_len
    at_row, at_token = 0, 0
    for k, (ids, at, ln, runs, doc_at) in enumerate(_visits(d, docs)):
        if how == "wrapped":
            doc, start, length, where = packing.wrapped_cuts(ids, at_token + np.cumsum(ln) - ln, ln, end, seq_len)
            at_token += int(ln.sum())
            pos = doc_at[doc - k * CHUNK] + start  # in tokens.bin
            row = where // seq_len
        else:  # none: a row per visit
            doc, start, length, pos = ids, np.zeros_like(ids), ln, at
            row = at_row + np.arange(len(ids), dtype=np.int64)
            at_row += len(ids)
        rows.add(doc, start, length, row, _segment_trained(pos, length, runs))


def _segment_trained(pos: np.ndarray, length: np.ndarray, runs: np.ndarray | None) -> np.ndarray:
    """Tokens with a label per segment at `pos` in tokens.bin: every trained token but its first (no token is
    predicted across a document boundary). `runs`: the trained runs around the segments (None: all train)."""
    if runs is None:
        return np.maximum(length - 1, 0)
    return _trained_before(runs, pos + length) - _trained_before(runs, pos + 1)


def _pack_bfd(docs: _Docs, seq_len: int, rows: "_RowWriter") -> None:
    lens, order = docs.lens, None
    if not docs.uniform:  # the mixture's visits, int32, a chunk at a time
        rng, pieces = np.random.default_rng(0), []
        for a in range(0, docs.count, CHUNK):
            ids = np.arange(a, min(a + CHUNK, docs.count), dtype=np.int32)
            pieces.append(np.repeat(ids, packing.mixture_copies(docs.part_weight[np.searchsorted(docs.part_end, ids, side="right")], rng)))
        order = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
        del pieces
        lens = lens[order]
    row_of, n_rows = packing.bfd_rows(lens, seq_len, CHUNK)
    step = max(1, CHUNK * n_rows // max(len(lens), 1))  # rows per step: ~CHUNK segments
    for r0 in range(0, n_rows, step):
        r1 = r0 + step
        pos = np.concatenate([np.flatnonzero((row_of[p:p + CHUNK] >= r0) & (row_of[p:p + CHUNK] < r1)) + p
                              for p in range(0, len(lens), CHUNK)])
        pos = pos[np.argsort(row_of[pos], kind="stable")]  # within a row: by position in the visiting order
        doc = pos if order is None else order[pos].astype(np.int64)
        length = lens[pos].astype(np.int64)
        trained = np.maximum(length - 1, 0) if docs.trained is None else docs.trained[doc].astype(np.int64)
        rows.add(doc, np.zeros_like(doc), length, row_of[pos].astype(np.int64), trained)


class _RowWriter:
    """segments.npy, row_ptr.npy and row_trained.npy, appended a chunk of segments at a time (rows in order); the
    split's totals and, for a mixture, each source's tokens and trained tokens in the rows."""

    def __init__(self, d: Path, docs: _Docs, n_sources: int):
        self.d, self.docs = d, docs
        self.stack = ExitStack()
        self.segments = NpyWriter(d / "segments.npy", np.int32, 2)
        self.row_ptr = NpyWriter(d / "row_ptr.npy", np.int64)
        self.row_trained = NpyWriter(d / "row_trained.npy", np.int32)
        self.segs, self.rows, self.open = 0, 0, 0  # segments so far, rows started, trained tokens of the open row
        self.tokens, self.trained = 0, 0
        self.src_tokens = np.zeros(n_sources)
        self.src_trained = np.zeros(n_sources)

    def __enter__(self):
        for w in (self.segments, self.row_ptr, self.row_trained):
            self.stack.enter_context(w)
        return self

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)

    def finish(self) -> None:
        """The last row's trained count and the closing row pointer (the segment count)."""
        if self.rows:
            self.row_trained.write(np.array([self.open]))
        self.row_ptr.write(np.array([self.segs]))

    def add(self, doc, start, length, row, trained) -> None:
        """Segments in order; `row`: each one's row, consecutive from the last chunk's."""
        self.segments.write(np.stack([doc, start], axis=1))
        new = np.flatnonzero(np.diff(row, prepend=self.rows - 1))  # the segments that start a row
        self.row_ptr.write(self.segs + new)
        cum = np.concatenate([[0], np.cumsum(trained)])
        if len(new):
            edges = np.append(new, len(row))
            if self.rows:
                self.row_trained.write(np.array([self.open + cum[new[0]]]))
            self.row_trained.write(np.diff(cum[edges])[:-1])
            self.open = int(cum[-1] - cum[new[-1]])
        else:
            self.open += int(cum[-1])
        self.rows += len(new)
        self.segs += len(doc)
        self.tokens += int(length.sum())
        self.trained += int(cum[-1])
        if len(self.src_tokens) > 1 and len(doc):
            src = self.docs.source_of(doc)
            self.src_tokens += np.bincount(src, weights=length, minlength=len(self.src_tokens))
            self.src_trained += np.bincount(src, weights=trained, minlength=len(self.src_tokens))

    def efficiency(self, seq_len: int) -> float:
        """Real tokens / token slots (rows x seq_len), as packing.Packed.efficiency."""
        return self.tokens / (self.rows * seq_len) if self.rows else 0.0


def _source_stats(sources, fmts: dict, stats, jobs, docs: _Docs, rows: _RowWriter) -> dict:
    """SourceStats of the train split per source of a mixture: examples from the parts, tokens and trained tokens
    from the packed segments (a weight-2 source's documents counted twice, as the rows hold them)."""
    n = len(sources)
    per_part = np.diff(docs.part_end, prepend=0)
    ends = np.concatenate([[0], np.cumsum(np.bincount(docs.part_source, weights=per_part, minlength=n))])
    out = {}
    for i, s in enumerate(sources):
        res = next((st["resolved"] for (_, sp), st in zip(jobs, stats) if sp == "train" and st["source"] == i
                    and st.get("resolved")), None) or {"train_on": "", "overflow": ""}
        examples = sum(st["splits"]["train"]["examples"] for (_, sp), st in zip(jobs, stats) if sp == "train" and st["source"] == i)
        out[i] = SourceStats(s.path, s.weight, fmts.get(i, "empty"), res["train_on"], res["overflow"], examples,
                             (int(ends[i]), int(ends[i + 1])), int(rows.src_tokens[i]), int(rows.src_trained[i]))
    return out


def _trained_before(spans: np.ndarray, x: np.ndarray) -> np.ndarray:
    """How many trained positions of `spans` (sorted, disjoint runs [start, end)) lie before each position in `x`."""
    if len(spans) == 0:
        return np.zeros_like(x)
    before = np.concatenate([[0], np.cumsum(spans[:, 1] - spans[:, 0])])
    k = np.searchsorted(spans[:, 0], x, side="right") - 1
    inside = np.clip(x - spans[np.maximum(k, 0), 0], 0, spans[np.maximum(k, 0), 1] - spans[np.maximum(k, 0), 0])
    return np.where(k >= 0, before[np.maximum(k, 0)] + inside, 0)
