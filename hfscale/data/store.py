"""The token store: tokenized once, by every rank together, memory-mapped by every rank after.

A store is a directory (made through a stage and one rename, hfscale.util.atomic):

    manifest.json           key, options, counts, and every file's size + xxh3 (the commit mark)
    train/, validation/     tokens.bin   uint16 (vocabulary <= 65,536) or uint32, all documents end to end
                            docs.npy     int64 [D + 1]  document d is tokens[docs[d]:docs[d+1]]
                            spans.npy    int64 [S, 2]   trained runs [start, end) (absent: every token trained)
                            segments.npy int32 [N, 2]   the packing: (document, start); a segment's length is the
                                                        rest of its document or of its row, whichever ends first
                            row_ptr.npy  int64 [R + 1]  row r = segments[row_ptr[r]:row_ptr[r+1]]
                            row_trained.npy int32 [R]   tokens of row r with a label (what a step's loss divides by)

Bytes per token: 2 (uint16) + 8 per document + 8 per segment + 12 per row (+ 16 per trained run where not every
token trains): 2.085 measured for ~200-token text documents in 2,048-token rows (benchmarks/data_pipeline.md).

The key (xxh3-64) covers the input bytes (every file's content hash, in order, with its mixture weight), the
tokenizer as it tokenizes (its serialized model, special tokens and chat template) and every option that
changes tokens or rows (format, train_on, packing, overflow, seq_len, validation / held-out fraction). A store
whose manifest holds another key is refused in one line, never used.

Building (`prepare`): the input is cut into work units that depend on the files only
(hfscale.data.sources); rank r of `world` tokenizes units r, r + world, ... and writes each as a part
(staged, renamed) under a work directory beside the store; rank 0 merges the parts in unit order, packs, and
renames the store into place; the other ranks wait for its manifest. No accelerate, no process group: ranks
coordinate through renames on the shared file system, so the store is the same bytes at any world size and a
part finished before a kill -9 is reused by the next attempt. Memory holds one unit (<= 32 MiB of input) per
rank, then at the merge (rank 0) the document lengths and the packing: a few int64 arrays of (documents + rows)
entries, ~0.9 bytes per token at seq_len 256 (benchmarks/data_pipeline.md (b), 4 GB of text); reading maps the files.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..util.errors import ConfigError, HfscaleError
from . import formats, packing, sources as src_mod

STORE_VERSION = 2  # 2: segments without their lengths
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")
OVERFLOW = {"truncate": "keep the first seq_len tokens", "drop": "skip the example",
            "split": "cut into pieces of seq_len tokens, each its own document"}
EXIT_DISK_FULL = 74  # EX_IOERR, as a failed checkpoint save (hfscale.train.state)
BATCH = 256  # text records tokenized per call: the fast tokenizer's batch path
# Test seams, empty in production: hook(point, unit_index, rank) after a part is written ("part") and before the
# store is renamed into place ("merge"); tests SIGKILL there. Nothing here reads the environment.
FAULT_HOOKS: list = []


class StoreWriteError(HfscaleError):
    """The disk filled (or failed) while writing a store: nothing half-written was left. Exit EXIT_DISK_FULL."""
    status = EXIT_DISK_FULL


@dataclass(frozen=True)
class DataOptions:
    """Everything besides the input and the tokenizer that changes a store's tokens or rows."""
    seq_len: int
    format: str | None = None  # detected from the columns when None
    train_on: str | None = None  # the format's default when None (formats.DEFAULT_TRAIN_ON)
    packing: str | None = None  # bfd, wrapped, none; None: wrapped for text, bfd otherwise
    overflow: str | None = None  # truncate, drop, split; None: split for text, truncate otherwise
    validation: str | None = None  # a held-out file; else `heldout` of the examples (by content hash)
    heldout: float = 0.05

    def __post_init__(self):
        if self.seq_len < 2:
            raise ConfigError(f"seq_len must be >= 2 (got {self.seq_len})")
        formats.check_train_on(self.format, self.train_on)
        if self.packing is not None and self.packing not in packing.PACKING:
            raise ConfigError(f"packing {self.packing!r} not understood; use one of {', '.join(packing.PACKING)}")
        if self.overflow is not None and self.overflow not in OVERFLOW:
            raise ConfigError(f"overflow {self.overflow!r} not understood; use one of {', '.join(OVERFLOW)}")
        if not 0.0 <= self.heldout < 1.0:
            raise ConfigError(f"heldout must be in [0, 1) (got {self.heldout})")

    def resolved(self, fmt: str, packing: str | None = None) -> dict:
        """The options of one format's data; `packing`: the store's where its sources hold several formats."""
        text = fmt in ("text", "tokenized")
        return {"format": fmt, "train_on": self.train_on or formats.DEFAULT_TRAIN_ON[fmt],
                "packing": self.packing or packing or ("wrapped" if text else "bfd"),
                "overflow": self.overflow or ("split" if text else "truncate"), "seq_len": self.seq_len}

    def store_packing(self, fmts) -> str:
        """One packing for the whole store: as given, else wrapped where every source is text-like, else bfd."""
        return self.packing or ("wrapped" if set(fmts) <= {"text", "tokenized"} else "bfd")


@dataclass(frozen=True)
class SplitStats:
    examples: int = 0
    documents: int = 0
    tokens: int = 0
    trained: int = 0  # tokens with a label in the packed rows (a document's first token never has one)
    truncated: int = 0
    dropped: int = 0
    split: int = 0
    rows: int = 0
    efficiency: float = 0.0  # real tokens / (rows x seq_len)

    @property
    def trained_share(self) -> float:
        return self.trained / self.tokens if self.tokens else 0.0


@dataclass(frozen=True)
class SourceStats:
    """One source of a mixture in the train split: its format and options, its documents [first, end) (a source's
    documents are contiguous: units go in source order), and what its segments put in the rows (weights applied)."""
    path: str
    weight: float
    format: str
    train_on: str
    overflow: str
    examples: int
    documents: tuple
    tokens: int
    trained: int


@dataclass(frozen=True)
class StoreInfo:
    """What `prepare` made or `open_store` found: the manifest, typed."""
    path: Path
    key: str
    options: dict
    dtype: str
    vocab: int
    splits: dict = field(default_factory=dict)  # split -> SplitStats
    bytes: int = 0
    reused: bool = False
    sources: tuple = ()  # SourceStats of a mixture's sources (train split); empty for one source


    def lines(self) -> list[str]:
        o = self.options
        out = [f"{self.path}: key {self.key}, format {o['format']}, train_on {o['train_on']}, packing {o['packing']}, "
               f"overflow {o['overflow']}, seq_len {o['seq_len']}, {self.dtype} tokens (vocabulary {self.vocab:,})"]
        for name, s in self.splits.items():
            out.append(f"  {name}: {s.examples:,} examples, {s.tokens:,} tokens, {s.trained:,} trained "
                       f"({s.trained_share:.1%}), truncated {s.truncated:,} / dropped {s.dropped:,} / split {s.split:,}; "
                       f"{s.rows:,} rows, packing efficiency {s.efficiency:.1%}")
        for i, s in enumerate(self.sources):
            out.append(f"  source {i} {s.path} (weight {s.weight:g}): {s.format}, train_on {s.train_on}, overflow "
                       f"{s.overflow}: {s.examples:,} examples, {s.tokens:,} tokens in rows, {s.trained:,} trained "
                       f"({s.trained / max(s.tokens, 1):.1%})")
        tokens = sum(s.tokens for s in self.splits.values())
        out.append(f"  {self.bytes / 1e6:,.1f} MB on disk, {self.bytes / max(tokens, 1):.2f} bytes per token")
        return out


def tokenizer_fingerprint(tokenizer) -> str:
    """What decides the tokens: the serialized fast tokenizer, its special tokens and its chat template."""
    from ..util.hashing import hash_text

    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    model = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hash_text(type(tokenizer).__name__, model, str(tokenizer.chat_template or ""),
                     repr((tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)))


def store_key(data, tokenizer, opts: DataOptions) -> str:
    from ..util.hashing import hash_text

    sources = src_mod.parse_sources(data)
    inputs = src_mod.input_fingerprint(sources, _validation_file(sources, opts))
    return hash_text(str(STORE_VERSION), json.dumps(inputs), tokenizer_fingerprint(tokenizer),
                     json.dumps(asdict(opts), sort_keys=True))[:16]


def _validation_file(sources, opts: DataOptions) -> str | None:
    if opts.validation:
        return opts.validation
    if len(sources) == 1 and sources[0].path in (src_mod.BUILTIN, src_mod.BUILTIN_CHAT):
        return str(src_mod.builtin_files(sources[0].path)["validation"])
    return None


# --- building --------------------------------------------------------------------------------------


def prepare(data, tokenizer, opts: DataOptions, out, rank: int = 0, world: int = 1, force: bool = False,
            poll_s: float = 0.1, log=None) -> StoreInfo:
    """Build the store at `out` (or reuse the one there with the same key), `world` processes sharing the work;
    every rank returns the same StoreInfo. `out` holding another store: refused unless `force`. `tokenizer`: a
    tokenizer, or a model name (hfscale.data.formats.data_tokenizer)."""
    from ..util.atomic import check_overlap, check_parents

    if isinstance(tokenizer, str):
        tokenizer = formats.data_tokenizer(tokenizer)
    out = Path(out)
    sources = src_mod.parse_sources(data)
    vfile = _validation_file(sources, opts)
    inputs = [f for s in sources for f in src_mod.files_of(s)] + ([Path(vfile)] if vfile else [])
    check_overlap({out: "--out"}, {str(f): "--data" for f in inputs})
    check_parents({out: "--out"})
    key = store_key(sources, tokenizer, opts)
    found = _reusable(out, key, force)
    if found is not None:
        return found
    units = src_mod.units_of(sources)
    vunits = src_mod.units_of((src_mod.Source(vfile),)) if vfile else []
    jobs = [(u, "train") for u in units] + [(u, "validation") for u in vunits]
    work = out.parent / f".{out.name}.work-{key}"
    started = time.time()
    try:
        tok = formats.Tok.of(tokenizer)
        store_packing = opts.store_packing(source_formats(units, opts))
        for i in range(rank, len(jobs), world):
            part = work / f"part-{i:06d}"
            if not part.is_dir():  # a part finished by an earlier, killed attempt is complete (renamed) and reused
                _write_part(part, jobs[i][0], jobs[i][1], tok, opts, vfile is None, len(tokenizer), store_packing)
            for hook in FAULT_HOOKS:
                hook("part", i, rank)
        if rank == 0:
            _wait(lambda: all((work / f"part-{i:06d}").is_dir() for i in range(len(jobs))), work, started, poll_s)
            info = _merge(work, jobs, sources, out, key, opts, len(tokenizer), log, store_packing)
            shutil.rmtree(work, ignore_errors=True)
            return info
        _wait(lambda: _manifest_key(out) == key, work, started, poll_s)
        return open_info(out)
    except (OSError, HfscaleError) as e:
        _fail(work, rank, world, e)
        cause = e if isinstance(e, OSError) else e.__cause__  # hfscale.util.atomic.staged words a full disk as a user error
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreWriteError(f"writing the token store {out} failed ({cause.strerror}); nothing half-written is left: "
                                  "free space or choose another --out") from None
        raise


def source_formats(units, opts: DataOptions) -> list[str]:
    """Each source's format (`format:` where given, else its first record's columns), read before any part is
    written: the store's packing depends on them, and a part's overflow on the packing."""
    if opts.format:
        return [opts.format]
    found: dict[int, str] = {}
    for u in units:
        if u.source not in found:
            for where, rec in src_mod.records(u):
                found[u.source] = formats.detect(rec.keys(), where)
                break
    return list(found.values())


def _reusable(out: Path, key: str, force: bool) -> StoreInfo | None:
    if not out.exists():
        return None
    have = _manifest_key(out)
    if have == key:
        return open_info(out, reused=True)
    if force:
        return None
    what = f"a token store of other data, tokenizer or options (key {have}, this one {key})" if have else "something else"
    raise HfscaleError(f"--out {out} holds {what}; pass --force to replace it, or choose another --out")


def _manifest_key(out: Path) -> str | None:
    try:
        return json.loads((out / MANIFEST).read_text()).get("key")
    except (OSError, ValueError, AttributeError):
        return None


def _fail(work: Path, rank: int, world: int, e: BaseException) -> None:
    """Tell the other ranks why this one stopped (they raise the same line instead of waiting forever); alone,
    leave nothing behind."""
    if world == 1:
        shutil.rmtree(work, ignore_errors=True)
        return
    try:
        from ..util.atomic import write_text_atomic

        work.mkdir(parents=True, exist_ok=True)
        write_text_atomic(work / f"error-rank{rank}", str(e) if isinstance(e, HfscaleError) else f"rank {rank}: {e}")
    except OSError:
        pass


def _wait(done, work: Path, started: float, poll_s: float) -> None:
    while not done():
        for f in sorted(work.glob("error-rank*")) if work.is_dir() else ():
            try:
                if f.stat().st_mtime >= started - 1:  # older ones are a previous attempt's
                    raise HfscaleError(f.read_text().strip())
            except FileNotFoundError:
                continue
        time.sleep(poll_s)


def _heldout(record: dict, frac: float) -> bool:
    """Held out by content (xxh3 of the record): the same example lands on the same side wherever it sits."""
    import xxhash

    return frac > 0 and xxhash.xxh3_64_intdigest(json.dumps(record, sort_keys=True, default=str).encode()) % 1_000_000 < frac * 1e6


def _write_part(part: Path, unit, split: str, tok, opts: DataOptions, hold_out: bool, vocab: int,
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


def _merge(work: Path, jobs, sources, out: Path, key: str, opts: DataOptions, vocab: int, log,
           store_packing: str | None = None) -> StoreInfo:
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
            lens, spans, weights, doc_source, base = [], [], [], [], 0
            with open(d / "tokens.bin", "wb") as f:
                for p, st in zip(parts, stats):
                    with open(p / f"{split}.tok", "rb") as g:
                        shutil.copyfileobj(g, f, 8 << 20)
                    ln = np.load(p / f"{split}.len.npy")
                    lens.append(ln)
                    doc_source.append(np.full(len(ln), st["source"]))
                    spans.append(np.load(p / f"{split}.span.npy") + base)
                    weights.append(np.full(len(ln), sources[st["source"]].weight if split == "train" else 1.0))
                    base += int(ln.sum())
            lens = np.concatenate(lens)
            docs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            spans = np.concatenate(spans).astype(np.int64)
            save(d / "docs.npy", docs)
            all_trained = bool(len(spans) == len(lens) and np.array_equal(spans[:, 0], docs[:-1])
                               and np.array_equal(spans[:, 1], docs[1:]))
            if not all_trained:
                save(d / "spans.npy", spans)
            order = packing.mixture_order(np.concatenate(weights))
            packed = packing.pack(lens, opts.seq_len, resolved["packing"], order)
            save(d / "segments.npy", packed.segments[:, :2])  # lengths follow: min(rest of the document, rest of the row)
            save(d / "row_ptr.npy", packed.row_ptr)
            per_seg = segment_trained(packed, docs, None if all_trained else spans)
            trained = _row_sums(packed, per_seg)
            save(d / "row_trained.npy", trained)
            if split == "train" and len(sources) > 1:
                per_source = _source_stats(sources, train_fmts, stats, jobs, np.concatenate(doc_source), packed, per_seg)
            c = {k: sum(st["splits"][split][k] for st in stats) for k in ("examples", "truncated", "dropped", "split")}
            splits[split] = SplitStats(documents=len(lens), tokens=packed.tokens, trained=int(trained.sum()),
                                       rows=packed.rows, efficiency=round(packed.efficiency, 6), **c)
            if split == "train" and splits[split].trained == 0:
                raise HfscaleError("no token of the training data is trained (every loss mask is empty after "
                                   f"train_on {resolved['train_on']} and overflow {resolved['overflow']}); check the data's "
                                   "roles / completions, raise seq_len, or use train_on: all")
            if split == "train" and packed.rows == 0:
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


def row_trained(packed, docs: np.ndarray, spans: np.ndarray | None) -> np.ndarray:
    """Tokens with a label per row: every trained token of a segment but its first (no token is predicted across
    a document boundary)."""
    return _row_sums(packed, segment_trained(packed, docs, spans))


def segment_trained(packed, docs: np.ndarray, spans: np.ndarray | None) -> np.ndarray:
    """Tokens with a label per segment (its first token never has one)."""
    seg = packed.segments.astype(np.int64)
    a = docs[seg[:, 0]] + seg[:, 1] + 1
    b = docs[seg[:, 0]] + seg[:, 1] + seg[:, 2]
    return np.maximum(b - a, 0) if spans is None else _trained_before(spans, b) - _trained_before(spans, a)


def _row_sums(packed, per_seg: np.ndarray) -> np.ndarray:
    cum = np.concatenate([[0], np.cumsum(per_seg)])
    return (cum[packed.row_ptr[1:]] - cum[packed.row_ptr[:-1]]).astype(np.int32)


def _source_stats(sources, fmts: dict, stats, jobs, doc_source: np.ndarray, packed, per_seg) -> dict:
    """SourceStats of the train split per source of a mixture: examples from the parts, tokens and trained tokens
    from the packed segments (a weight-2 source's documents counted twice, as the rows hold them)."""
    seg_src = doc_source[packed.segments[:, 0]] if len(doc_source) else np.zeros(0, np.int64)
    n = len(sources)
    tokens = np.bincount(seg_src, weights=packed.segments[:, 2], minlength=n)
    trained = np.bincount(seg_src, weights=per_seg, minlength=n)
    ends = np.concatenate([[0], np.cumsum(np.bincount(doc_source, minlength=n))]) if len(doc_source) else np.zeros(n + 1)
    out = {}
    for i, s in enumerate(sources):
        res = next((st["resolved"] for (_, sp), st in zip(jobs, stats) if sp == "train" and st["source"] == i
                    and st.get("resolved")), None) or {"train_on": "", "overflow": ""}
        examples = sum(st["splits"]["train"]["examples"] for (_, sp), st in zip(jobs, stats) if sp == "train" and st["source"] == i)
        out[i] = SourceStats(s.path, s.weight, fmts.get(i, "empty"), res["train_on"], res["overflow"], examples,
                             (int(ends[i]), int(ends[i + 1])), int(tokens[i]), int(trained[i]))
    return out


def _trained_before(spans: np.ndarray, x: np.ndarray) -> np.ndarray:
    """How many trained positions lie before each position in `x` (spans sorted, disjoint)."""
    if len(spans) == 0:
        return np.zeros_like(x)
    before = np.concatenate([[0], np.cumsum(spans[:, 1] - spans[:, 0])])
    k = np.searchsorted(spans[:, 0], x, side="right") - 1
    inside = np.clip(x - spans[np.maximum(k, 0), 0], 0, spans[np.maximum(k, 0), 1] - spans[np.maximum(k, 0), 0])
    return np.where(k >= 0, before[np.maximum(k, 0)] + inside, 0)


# --- reading ---------------------------------------------------------------------------------------


def read_manifest(path) -> dict:
    path = Path(path)
    try:
        m = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise HfscaleError(f"{path} is not a token store (no {MANIFEST}); make one with hfscale data prepare") from None
    except (OSError, ValueError) as e:
        raise HfscaleError(f"{path}/{MANIFEST} is damaged ({e}); prepare the store again") from None
    if not isinstance(m, dict) or m.get("version") != STORE_VERSION or "files" not in m:
        raise HfscaleError(f"{path} is a token store of another version or damaged; prepare it again")
    return m


def verify(path, full: bool = False) -> dict:
    """The manifest, after checking the store's files against it (sizes; with `full`, content hashes too)."""
    from ..util.hashing import files_of, hash_file

    path = Path(path)
    m = read_manifest(path)
    present = set(files_of(path, exclude=(MANIFEST,)))
    for name, (size, digest) in sorted(m["files"].items()):
        if name not in present:
            raise HfscaleError(f"token store {path} is damaged: {name} is missing; prepare it again")
        if (path / name).stat().st_size != size:
            raise HfscaleError(f"token store {path} is damaged: {name} has {(path / name).stat().st_size:,} bytes, its "
                               f"manifest says {size:,}; prepare it again")
        if full and hash_file(path / name)[1] != digest:
            raise HfscaleError(f"token store {path} is damaged: {name} differs from its manifest's hash; prepare it again")
    return m


def open_info(path, reused: bool = False, full: bool = False) -> StoreInfo:
    path = Path(path)
    m = verify(path, full)
    return StoreInfo(path, m["key"], m["options"], m["dtype"], m["vocab"],
                     {k: SplitStats(**v) for k, v in m["splits"].items()},
                     sum(v[0] for v in m["files"].values()) + (path / MANIFEST).stat().st_size, reused,
                     tuple(SourceStats(**{**v, "documents": tuple(v["documents"])}) for v in m.get("sources", ())))


class TokenStore:
    """One split of a store, memory-mapped: rows as (input_ids, labels, position_ids) int64 arrays."""

    def __init__(self, path, split: str = "train", expect_key: str | None = None):
        path = Path(path)
        m = verify(path)
        if expect_key is not None and m["key"] != expect_key:
            raise HfscaleError(f"token store {path} was made from other data, tokenizer or options (key {m['key']}, "
                               f"expected {expect_key}); prepare it again or pass the matching store")
        d = path / split
        self.path, self.key, self.options, self.manifest = path, m["key"], m["options"], m
        self.seq_len = int(m["options"]["seq_len"])
        self.tokens = np.memmap(d / "tokens.bin", dtype=m["dtype"], mode="r") if (d / "tokens.bin").stat().st_size \
            else np.zeros(0, dtype=m["dtype"])
        self.docs = np.load(d / "docs.npy", mmap_mode="r")
        self.spans = None if m["all_trained"][split] else np.load(d / "spans.npy", mmap_mode="r")
        self.segments = np.load(d / "segments.npy", mmap_mode="r")
        self.row_ptr = np.load(d / "row_ptr.npy", mmap_mode="r")
        self.row_trained = np.load(d / "row_trained.npy", mmap_mode="r")

    def __len__(self) -> int:
        return len(self.row_ptr) - 1

    def row(self, i: int):
        """(input_ids, labels, position_ids) of packed row i, unpadded: labels -100 where untrained and at every
        segment's first token; position ids restart at 0 per segment."""
        ids, labels, pos = [], [], []
        used = 0
        for doc, start in self.segments[self.row_ptr[i]: self.row_ptr[i + 1]].tolist():
            length = min(int(self.docs[doc + 1] - self.docs[doc]) - start, self.seq_len - used)
            used += length
            a = int(self.docs[doc]) + start
            t = np.asarray(self.tokens[a: a + length], dtype=np.int64)
            lab = t.copy()
            if self.spans is not None:
                lab[~self._mask(a, a + length)] = -100
            lab[0] = -100
            ids.append(t)
            labels.append(lab)
            pos.append(np.arange(length, dtype=np.int64))
        return np.concatenate(ids), np.concatenate(labels), np.concatenate(pos)

    def _mask(self, a: int, b: int) -> np.ndarray:
        m = np.zeros(b - a, dtype=bool)
        lo = np.searchsorted(self.spans[:, 1], a, side="right")
        hi = np.searchsorted(self.spans[:, 0], b, side="left")
        for s, e in self.spans[lo:hi].tolist():
            m[max(s, a) - a: min(e, b) - a] = True
        return m
