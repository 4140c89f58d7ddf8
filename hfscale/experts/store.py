"""Where a model's routed experts live on disk, and reading one expert from there.

transformers v5 keeps each MoE layer's routed experts as two 3-D parameters (`Gemma4TextExperts`,
`MixtralExperts`, `Qwen2MoeExperts`, ...): `gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
`down_proj` [E, H, I]. Checkpoints store them in one of two layouts, each a `Layout` here:
- packed (Gemma 4, and whatever transformers v5 saves without a conversion mapping): the same 3-D
  tensors; expert e is the contiguous byte range [e * row, (e + 1) * row) of each.
- per expert (Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`, Qwen-MoE's
  `mlp.experts.{e}.gate_proj/up_proj/down_proj`; transformers 5.24 saves Mixtral this way):
  gate_up is gate and up concatenated on rows, as transformers' MergeModulelist + Concatenate(dim=1)
  builds it on load.

Two readers, same bytes (tests/test_experts.py: bit-identical logits with either):
- "pread" (default): the tensor's byte range is read with os.pread from offsets in the safetensors
  header. Nothing of the file is mapped into the process, so its resident set is the expert cache
  plus the resident weights: the budget is what `ps` shows.
- "mmap": the expert's byte range is mapped (MAP_POPULATE) and used in place, without a copy: the
  cache holds mappings, and an evicted expert is unmapped once the forward no longer uses it, so the
  process's RSS (file-backed) stays bounded by the budget like pread's (anonymous). Faster (no memcpy
  from the page cache), but a file truncated while an expert of it is mapped and used kills the
  process with SIGBUS (a truncation before the read is caught by a size check); pread raises a clean
  error at any time.
A read that fails (missing or truncated file, bad header) raises HfscaleError naming the file.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from ..util.errors import HfscaleError, first_line

READERS = ("pread", "mmap")
# safetensors dtype names -> torch dtype names
_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


@dataclass(frozen=True)
class Layout:
    """How one experts module's weights are named in a checkpoint. `gate_up`/`down`: key templates
    ({m} = the module's name in the checkpoint, {e} = expert index); two gate_up templates are
    concatenated on rows. `renames`: (regex, replacement) from checkpoint names to module names."""
    name: str
    gate_up: tuple[str, ...]
    down: str
    renames: tuple[tuple[str, str], ...] = ()

    @property
    def packed(self) -> bool:
        return "{e}" not in self.down

    def to_checkpoint(self, module_name: str) -> str:
        for pattern, repl in self.renames:  # inverse of each rename: module name -> checkpoint name
            module_name = module_name.replace(repl, pattern)
        return module_name

    def to_model(self, key: str) -> str:
        for pattern, repl in self.renames:
            key = key.replace(pattern, repl)
        return key


LAYOUTS = (
    Layout("packed", ("{m}.gate_up_proj",), "{m}.down_proj"),
    Layout("mixtral", ("{m}.{e}.w1.weight", "{m}.{e}.w3.weight"), "{m}.{e}.w2.weight",
           renames=((".block_sparse_moe.", ".mlp."),)),
    Layout("qwen-moe", ("{m}.{e}.gate_proj.weight", "{m}.{e}.up_proj.weight"), "{m}.{e}.down_proj.weight"),
)


@dataclass(frozen=True)
class TensorRef:
    name: str
    file: Path
    dtype: str          # safetensors dtype name
    shape: tuple[int, ...]
    start: int          # absolute byte offset of the tensor in the file
    nbytes: int


def read_header(file: Path) -> dict[str, TensorRef]:
    """Tensor name -> TensorRef from a safetensors file's header (8-byte little-endian length, JSON)."""
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n < 100 * 2**20:
                raise ValueError(f"header length {n} is not plausible")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise HfscaleError(f"cannot read the safetensors header of {file} ({first_line(e, 160)}); "
                           "re-save the model with save_pretrained") from None
    refs = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        refs[name] = TensorRef(name, file, info["dtype"], tuple(info["shape"]), 8 + n + b, e - b)
    return refs


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a transformers directory (one file, or the shards its index lists)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise HfscaleError(f"{path} has no model.safetensors (or index); experts are read from safetensors files: "
                       "save the model with save_pretrained(safe_serialization=True)")


def all_tensors(files: list[Path]) -> dict[str, TensorRef]:
    refs: dict[str, TensorRef] = {}
    for f in files:
        refs.update(read_header(f))
    return refs


@dataclass(frozen=True)
class ExpertSource:
    """One experts module's weights on disk. `refs(e)`: the gate_up parts (concatenated on rows) and
    down of expert e, each as (TensorRef, index into its first axis, or -1 for a per-expert tensor)."""
    layout: Layout
    module: str                       # name in the checkpoint
    tensors: dict[str, TensorRef]     # every key of this module

    def refs(self, e: int) -> tuple[list[tuple[TensorRef, int]], tuple[TensorRef, int]]:
        def one(template: str) -> tuple[TensorRef, int]:
            return self.tensors[template.format(m=self.module, e=e)], (e if self.layout.packed else -1)

        return [one(t) for t in self.layout.gate_up], one(self.layout.down)


def find_source(module_name: str, tensors: dict[str, TensorRef]) -> ExpertSource | None:
    for layout in LAYOUTS:
        m = layout.to_checkpoint(module_name)
        if layout.down.format(m=m, e=0) in tensors and all(t.format(m=m, e=0) in tensors for t in layout.gate_up):
            prefix = m + "."
            return ExpertSource(layout, m, {k: v for k, v in tensors.items() if k.startswith(prefix)})
    return None


def expert_keys(sources: list[ExpertSource]) -> set[str]:
    """Checkpoint keys that hold routed-expert weights (never loaded whole)."""
    pat = {re.escape(s.module) for s in sources}
    rx = re.compile("^(" + "|".join(pat) + r")\.(gate_up_proj|down_proj|\d+\.)")
    return {k for s in sources for k in s.tensors if rx.match(k)}


class Reader:
    """Reads one expert's tensors through one descriptor per checkpoint file; close() releases them.
    `read` copies the bytes (pread); `map` maps them (mmap). A failure of either closes that file's
    descriptor, so the next attempt opens it again by path (a file replaced since is read anew)."""

    def __init__(self, kind: str = "pread"):
        if kind not in READERS:
            raise HfscaleError(f"expert reader {kind!r} is not known; choose one of {', '.join(READERS)}")
        self.kind = kind
        self._open: dict[Path, int] = {}
        self._lock = threading.Lock()  # reads run on the caller's thread and on the cache's worker

    def _handle(self, file: Path) -> int:
        with self._lock:
            h = self._open.get(file)
            if h is None:
                try:
                    h = os.open(file, os.O_RDONLY)
                except OSError as e:
                    raise HfscaleError(f"cannot open expert weights {file} ({first_line(e, 160)}); the model directory "
                                       "changed since loading: put the file back or load the model again") from None
                self._open[file] = h
            return h

    @staticmethod
    def _range(ref: TensorRef, index: int) -> tuple[int, int, tuple[int, ...]]:
        """(absolute start, bytes, shape) of expert `index` of a packed [E, ...] tensor, or of a whole
        per-expert tensor (index -1)."""
        if index < 0:
            return ref.start, ref.nbytes, ref.shape
        n = ref.nbytes // ref.shape[0]
        return ref.start + n * index, n, ref.shape[1:]

    def _failed(self, ref: TensorRef, e: Exception):
        with self._lock:
            h = self._open.pop(ref.file, None)
        if h is not None:
            os.close(h)
        return HfscaleError(f"reading expert weights from {ref.file} failed ({first_line(e, 160)}); "
                            "check the file (re-save the model) and load it again")

    def read(self, ref: TensorRef, index: int, dtype, out=None):
        """The tensor's bytes copied with os.preadv, as `dtype`. `out`: a uint8 tensor of exactly its bytes
        in `dtype` to read into (a recycled buffer); the result is then a view of it."""
        import torch

        start, n, shape = self._range(ref, index)
        src = getattr(torch, _DTYPES[ref.dtype])
        h = self._handle(ref.file)
        direct = out is not None and src == dtype
        buf = out if direct else torch.empty(n, dtype=torch.uint8)
        try:
            done = os.preadv(h, [memoryview(buf.numpy())], start)
            if done != n:
                raise OSError(f"short read: {done} of {n} bytes at offset {start} (truncated file?)")
        except OSError as e:
            raise self._failed(ref, e) from None
        got = buf.view(src).reshape(shape)
        if direct:
            return got
        if out is not None:
            return out.view(dtype).view(shape).copy_(got)
        return got.to(dtype) if got.dtype != dtype else got

    def map(self, ref: TensorRef, index: int, dtype):
        """The tensor's pages mapped read-only (MAP_POPULATE: the page tables are filled, and pages not in
        the page cache read, inside this call) and viewed as a tensor without a copy; unmapped when the
        last tensor using them is freed. The file's size is checked first, so a file truncated before the
        read raises; one truncated while its pages are mapped and used faults (SIGBUS), as any mmap does."""
        import mmap
        import warnings

        import torch

        start, n, shape = self._range(ref, index)
        src = getattr(torch, _DTYPES[ref.dtype])
        h = self._handle(ref.file)
        try:
            size = os.fstat(h).st_size
            if start + n > size:
                raise OSError(f"the file is {size} bytes, the tensor ends at byte {start + n} (truncated file?)")
            base = start - start % mmap.ALLOCATIONGRANULARITY
            mm = mmap.mmap(h, n + start - base, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ,
                           offset=base)
        except (OSError, ValueError) as e:
            raise self._failed(ref, e) from None
        with warnings.catch_warnings():  # read-only pages: the forward never writes expert weights
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(mm, dtype=src, count=n // src.itemsize, offset=start - base).view(shape)
        return t.to(dtype) if src != dtype else t

    def close(self) -> None:
        with self._lock:
            handles, self._open = list(self._open.values()), {}
        for h in handles:
            os.close(h)
