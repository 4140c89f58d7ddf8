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

Two readers, same bytes:
- "pread" (default): the tensor's byte range is read with os.pread from offsets in the safetensors
  header. Nothing of the file is mapped into the process, so its resident set is the expert cache
  plus the resident weights: the budget is what `ps` shows.
- "mmap": safetensors' own `safe_open(...).get_slice(name)[e]` on the memory-mapped file. Pages it
  touches count in the process's RSS (file-backed, reclaimable) until the file is closed, so RSS
  grows towards the size of every expert ever read (measured in benchmarks/experts.py), and a file
  truncated under a running model kills the process with SIGBUS, where pread raises a clean error.
A read that fails (missing or truncated file, bad header) raises HfscaleError naming the file.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import HfscaleError, first_line

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
    """Reads one expert's tensors. Holds an open file (pread: a descriptor; mmap: safetensors'
    safe_open) per checkpoint file; close() releases them."""

    def __init__(self, kind: str = "pread"):
        if kind not in READERS:
            raise HfscaleError(f"expert reader {kind!r} is not known; choose one of {', '.join(READERS)}")
        self.kind = kind
        self._open: dict[Path, object] = {}

    def _handle(self, file: Path):
        h = self._open.get(file)
        if h is None:
            try:
                if self.kind == "pread":
                    h = os.open(file, os.O_RDONLY)
                else:
                    from safetensors import safe_open

                    h = safe_open(str(file), framework="pt")
            except Exception as e:  # noqa: BLE001 - OSError or SafetensorError: one line either way
                raise HfscaleError(f"cannot open expert weights {file} ({first_line(e, 160)}); "
                                   "the model directory changed since loading: load it again") from None
            self._open[file] = h
        return h

    def read(self, ref: TensorRef, index: int, dtype):
        """Expert `index` of a packed [E, ...] tensor (index >= 0), or the whole per-expert tensor (-1)."""
        import torch

        shape = ref.shape[1:] if index >= 0 else ref.shape
        h = self._handle(ref.file)
        try:
            if self.kind == "mmap":
                t = h.get_slice(ref.name)
                out = t[index] if index >= 0 else t[:]
            else:
                n = ref.nbytes // ref.shape[0] if index >= 0 else ref.nbytes
                start = ref.start + (n * index if index >= 0 else 0)
                buf = torch.empty(n, dtype=torch.uint8)
                got = os.preadv(h, [memoryview(buf.numpy())], start)
                if got != n:
                    raise OSError(f"short read: {got} of {n} bytes at offset {start} (truncated file?)")
                out = buf.view(getattr(torch, _DTYPES[ref.dtype])).reshape(shape)
        except HfscaleError:
            raise
        except Exception as e:  # noqa: BLE001 - I/O and safetensors errors become one line
            raise HfscaleError(f"reading expert weights from {ref.file} failed ({first_line(e, 160)}); "
                               "check the file (re-save the model) and load it again") from None
        return out.to(dtype) if out.dtype != dtype else out

    def close(self) -> None:
        for h in self._open.values():
            if isinstance(h, int):
                os.close(h)
        self._open.clear()
