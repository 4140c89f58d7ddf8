"""Where each parameter's bytes lie inside a training checkpoint, without loading the checkpoint.

A torch.save file is a zip: `data.pkl` (the object tree) and one stored (uncompressed) entry per storage.
`tensor_index(path)` unpickles only the tree, with every storage replaced by an empty meta-device one, so
no tensor data is read, and returns each tensor's place in the file: (byte offset, dtype, shape).
Unpickling is restricted (`_Restricted`): torch's tensor rebuilders and plain containers are built, any
other class becomes an inert stand-in, so a checkpoint cannot run code (weights_only in spirit; DeepSpeed's
files also pickle its config objects, which torch's weights_only loader refuses).

`zero_pieces(ckpt_dir)` maps every parameter of a DeepSpeed ZeRO-1/2/3 checkpoint to the byte ranges of
its fp32 master copy across the rank files (the values zero_to_fp32 consolidates); `safetensors_pieces`
does the same for a safetensors file (DDP checkpoints). hfscale.export.ckpt_export streams those ranges.
"""

from __future__ import annotations

import math
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..util.errors import HfscaleError


@dataclass(frozen=True)
class Piece:
    """`nbytes` bytes at `offset` of `file`: one contiguous run of a tensor's data."""
    file: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class TensorSource:
    name: str
    dtype: str  # safetensors dtype name: F32, BF16, F16
    shape: tuple
    pieces: tuple  # Pieces, in order; their bytes concatenated are the tensor, row-major

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclass(frozen=True)
class _Ref:
    """A tensor found in the pickle: its storage entry, element offset, dtype, shape (contiguous)."""
    key: str
    offset: int
    dtype: object
    shape: tuple


class _Inert:
    """What any class outside the allowlist unpickles to: it keeps its constructor arguments, runs nothing."""

    def __init__(self, *a, **k):
        self.args = a

    def __setstate__(self, state):
        pass


_ALLOWED = {("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"), ("torch", "Size"),
            ("torch", "device"), ("torch._utils", "_rebuild_parameter"), ("builtins", "set"), ("builtins", "frozenset"),
            ("builtins", "slice"), ("builtins", "complex"), ("torch._tensor", "_rebuild_from_type_v2"), ("torch", "Tensor")}


class _Restricted(pickle.Unpickler):
    def __init__(self, f, storages: dict):
        super().__init__(f)
        self.storages = storages

    def find_class(self, module, name):
        import torch

        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and name.endswith("Storage") and hasattr(torch, name):
            return getattr(torch, name)
        if module == "torch" and name in ("float32", "bfloat16", "float16", "float64", "int64", "int32", "uint8", "bool"):
            return getattr(torch, name)
        return _Inert

    def persistent_load(self, saved_id):
        import torch

        import warnings

        _, storage_type, key, _location, numel = saved_id
        with warnings.catch_warnings():  # legacy typed storage classes (torch.FloatStorage) warn on use
            warnings.simplefilter("ignore")
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        untyped = torch.UntypedStorage(nbytes, device="meta")
        self.storages[untyped._cdata] = str(key)  # the C++ storage: stable, unlike the Python wrapper
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def _data_offsets(zf: zipfile.ZipFile, path: Path) -> dict[str, int]:
    """Storage key -> absolute byte offset of its data (entries must be stored, as torch.save writes them)."""
    out = {}
    with open(path, "rb") as f:
        for info in zf.infolist():
            parts = info.filename.split("/")
            if len(parts) >= 3 and parts[-2] == "data":
                if info.compress_type != zipfile.ZIP_STORED:
                    raise HfscaleError(f"{path}: entry {info.filename} is compressed; not a torch.save file")
                f.seek(info.header_offset)
                head = f.read(30)
                if head[:4] != b"PK\x03\x04":
                    raise HfscaleError(f"{path}: damaged zip entry {info.filename}")
                name_len, extra_len = struct.unpack("<HH", head[26:30])
                out[parts[-1]] = info.header_offset + 30 + name_len + extra_len
    return out


def _walk(obj, storages: dict, out: list, path=()):
    import torch

    if isinstance(obj, torch.Tensor):
        key = storages.get(obj.untyped_storage()._cdata)
        if key is not None:
            out.append((path, _Ref(key, obj.storage_offset(), obj.dtype, tuple(obj.shape))))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, storages, out, path + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, storages, out, path + (i,))


def read_tree(path: Path):
    """(the object tree with meta tensors, {tree path: (absolute byte offset, dtype, shape)}) of a torch.save file."""
    import torch

    path = Path(path)
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise HfscaleError(f"{path} is not a readable torch checkpoint file ({e}); the checkpoint is damaged") from None
    with zf:
        pkl = next((n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            raise HfscaleError(f"{path} holds no data.pkl; not a torch checkpoint file")
        storages: dict = {}
        try:
            with zf.open(pkl) as f:
                tree = _Restricted(f, storages).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, zipfile.BadZipFile) as e:
            raise HfscaleError(f"{path}: cannot read its object tree ({type(e).__name__}: {e}); the file is damaged") from None
        offsets = _data_offsets(zf, path)
    refs: list = []
    _walk(tree, storages, refs)
    size = path.stat().st_size
    index = {}
    for p, ref in refs:
        item = torch.empty((), dtype=ref.dtype).element_size()
        start = offsets[ref.key] + ref.offset * item
        if start + math.prod(ref.shape) * item > size:
            raise HfscaleError(f"{path} is truncated: {'/'.join(map(str, p))} ends past the file's {size:,} bytes")
        index[p] = (start, ref.dtype, ref.shape)
    return tree, index


def zero_pieces(ds_dir: Path) -> tuple[list[TensorSource], dict]:
    """Every trainable parameter of a DeepSpeed ZeRO checkpoint directory (the tag dir, e.g. step_N/pytorch_model)
    as fp32 byte ranges across its rank files, in the model's order; and facts (stage, world)."""
    ds_dir = Path(ds_dir)
    optim = sorted(ds_dir.glob("*_optim_states.pt"), key=lambda p: int(p.name.split("rank_")[1].split("_")[0]))
    models = sorted(ds_dir.glob("*model_states.pt"))
    if not optim or not models:
        raise HfscaleError(f"{ds_dir} holds no DeepSpeed optimizer / model state files; give a checkpoint directory "
                           "(OUTPUT_DIR/checkpoints/step_N)")
    trees = [read_tree(p) for p in optim]
    first = trees[0][0]["optimizer_state_dict"]
    stage, world = first["zero_stage"], first["partition_count"]
    stage = int(stage.args[0] if isinstance(stage, _Inert) else stage)  # a ZeroStageEnum, kept inert
    world = max(world) if isinstance(world, list) else world
    if world != len(optim):
        raise HfscaleError(f"{ds_dir}: the optimizer state says {world} ranks but {len(optim)} rank files are there; "
                           "a rank file is missing: use an intact checkpoint")
    model_tree, _ = read_tree(models[0])
    shapes = model_tree["param_shapes"]  # one {name: shape} per parameter group
    shapes = shapes if isinstance(shapes, list) else [shapes]
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    # groups[r][g] = (byte offset, dtype, shape) of parameter group g's flat fp32 tensor in rank r's file
    groups = [[idx[p] for p in sorted((p for p in idx if p[:2] == ("optimizer_state_dict", key) and len(p) == 3),
                                      key=lambda p: p[2])] for _, idx in trees]
    out: list[TensorSource] = []
    if stage <= 2:
        # ZeRO-1/2: group g's flat vector (parameters back to back, padded at the end) is cut into `world`
        # contiguous partitions, rank r holding the r-th
        for g, named in enumerate(shapes):
            parts = [(groups[r][g], optim[r]) for r in range(world)]
            offset = 0
            for name, shape in named.items():
                n = math.prod(shape)
                out.append(TensorSource(name, "F32", tuple(shape), tuple(_span(parts, offset, n))))
                offset += n
    else:
        # ZeRO-3: each parameter is cut into `world` pieces of ceil(n / world) (the last padded); rank r's flat
        # groups hold its piece of every parameter, back to back, in order
        cursor = 0
        for named in shapes:
            for name, shape in named.items():
                n = math.prod(shape)
                part = math.ceil(n / world)
                pieces, left = [], n
                for r in range(world):
                    take = min(part, left)
                    if take > 0:
                        pieces += _span([(t, optim[r]) for t in groups[r]], cursor, take)
                    left -= take
                out.append(TensorSource(name, "F32", tuple(shape), tuple(pieces)))
                cursor += part
    return out, {"zero": stage, "world": world}


def _span(parts, offset: int, n: int) -> list[Piece]:
    """Byte pieces for elements [offset, offset + n) of the concatenation of `parts`
    ([((byte offset, dtype, shape), file), ...], fp32)."""
    pieces, pos = [], 0
    for (start, _dtype, shape), f in parts:
        length = math.prod(shape)
        lo, hi = max(offset, pos), min(offset + n, pos + length)
        if lo < hi:
            pieces.append(Piece(str(f), start + (lo - pos) * 4, (hi - lo) * 4))
        pos += length
    if sum(p.nbytes for p in pieces) != n * 4:
        raise HfscaleError("the optimizer partitions are shorter than the model's parameters; the checkpoint is damaged")
    return pieces


def safetensors_pieces(path: Path) -> list[TensorSource]:
    """Every tensor of a safetensors file as one byte range (its header read, nothing else)."""
    import json

    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HfscaleError(f"{path} is truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise HfscaleError(f"{path}: damaged safetensors header") from None
    size = path.stat().st_size
    out = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        if 8 + n + b > size:
            raise HfscaleError(f"{path} is truncated: {name} ends past the file's {size:,} bytes")
        out.append(TensorSource(name, t["dtype"], tuple(t["shape"]), (Piece(str(path), 8 + n + a, b - a),)))
    return out
