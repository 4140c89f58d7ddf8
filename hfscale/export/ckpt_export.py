"""`hfscale checkpoint info|export`: what a recipe checkpoint holds, and a plain transformers directory from it
with bounded memory.

export streams every parameter's fp32 bytes (hfscale.export.ckpt_reader: DeepSpeed ZeRO-1/2/3 rank files,
DDP's model.safetensors) into sharded safetensors files in CHUNK-sized reads: the safetensors header is
computed from the shapes first, then each tensor's bytes are copied piece by piece, so peak memory is the
chunk plus a fixed overhead, whatever the model or its largest tensor. The values are DeepSpeed's fp32
master weights, the ones `zero_to_fp32` consolidates (byte-identical); the output is staged and renamed
(hfscale.util.atomic) and holds config.json, the shards and model.safetensors.index.json.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from ..util.errors import HfscaleError

CHUNK = 16 << 20  # bytes copied at a time
DEFAULT_SHARD = 2 * 10**9


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    step: int
    engine: str
    zero: int | None
    ranks: int
    precision: str | None
    tokens_per_step: int | None
    model: str | None
    intact: str  # "yes", or what is wrong
    universal: bool  # a DeepSpeed universal conversion sits beside it
    adapter: str | None = None  # an adapter run's checkpoint (hfscale.scale.adapters): the spec, described
    base: dict | None = None  # an adapter-only checkpoint's base, which it does not hold (hfscale.train.adapter_ckpt)

    @property
    def tokens_seen(self) -> int | None:
        return self.step * self.tokens_per_step if self.tokens_per_step else None

    def lines(self) -> list[str]:
        zero = f" ZeRO-{self.zero}" if self.zero is not None else ""
        seen = f"{self.tokens_seen:,} tokens seen ({self.tokens_per_step:,}/step)" if self.tokens_seen else "tokens unknown"
        return [f"{self.path}: step {self.step}, {self.engine}{zero} on {self.ranks} rank{'s' if self.ranks != 1 else ''}, "
                f"{self.precision or 'precision unknown'}, {seen}",
                f"model {self.model}; intact: {self.intact}"
                + ("; universal conversion beside it" if self.universal else "")
                + (f"; adapter {self.adapter} on a frozen base" if self.adapter else "")] + (
            [f"adapter only: the base is not in it; it needs {_base_words(self.base)}"] if self.base else [])


def _base_words(base: dict) -> str:
    seed = f" seed {base['seed']}" if "seed" in base else ""
    return f"{base.get('source')}{seed} (frozen base digest {base.get('digest')})"


@dataclass(frozen=True)
class ExportResult:
    out: str
    tensors: int
    shards: int
    bytes: int


def _marker(ckpt: Path) -> dict:
    from ..train.state import MARKER

    if not ckpt.is_dir():
        raise HfscaleError(f"{ckpt} is not a directory; give a checkpoint directory (OUTPUT_DIR/checkpoints/step_N)")
    try:
        return json.loads((ckpt / MARKER).read_text())
    except FileNotFoundError:
        raise HfscaleError(f"{ckpt} is not a complete hfscale checkpoint (no {MARKER}); give OUTPUT_DIR/checkpoints/step_N") from None
    except (OSError, ValueError) as e:
        raise HfscaleError(f"{ckpt}/{MARKER} is unreadable ({e}); the checkpoint is damaged") from None


def info(ckpt: str | os.PathLike) -> CheckpointInfo:
    from ..train.reshape import DS_TAG, saved_facts, universal_dir
    from ..train.state import damage

    ckpt = Path(ckpt)
    meta = _marker(ckpt)
    facts = saved_facts(ckpt, meta)
    why = damage(ckpt, meta)
    zero = facts.get("zero")
    if zero is None and facts["engine"] == "deepspeed" and (ckpt / DS_TAG).is_dir():
        from .ckpt_reader import zero_pieces

        zero = zero_pieces(ckpt / DS_TAG)[1]["zero"]
    return CheckpointInfo(str(ckpt), int(meta.get("step", 0)), facts["engine"], zero, int(facts["ranks"]),
                          facts.get("precision"), meta.get("tokens_per_step"), meta.get("model"),
                          "yes" if why is None else f"no ({why})", universal_dir(ckpt).is_dir(), _adapter(meta),
                          _base(meta))


def _base(meta: dict) -> dict | None:
    """An adapter-only checkpoint's base (hfscale.train.adapter_ckpt), or None (a marker's base that is not a mapping)."""
    return meta.get("base") if isinstance(meta.get("base"), dict) else None


def _adapter(meta: dict) -> str | None:
    spec = (meta.get("model_fingerprint") or {}).get("adapter")
    if not spec:
        return None
    from ..scale.adapters import AdapterSpec

    return AdapterSpec.from_mapping(spec).describe()


def _sources(ckpt: Path):
    from ..train.reshape import DS_TAG
    from .ckpt_reader import safetensors_pieces, zero_pieces

    if (ckpt / DS_TAG).is_dir():
        return zero_pieces(ckpt / DS_TAG)[0]
    files = sorted(ckpt.glob("model*.safetensors"))
    if not files:
        raise HfscaleError(f"{ckpt} holds neither DeepSpeed state ({DS_TAG}/) nor model.safetensors; "
                           "give a recipe checkpoint directory")
    return [t for f in files for t in safetensors_pieces(f)]


def _plan_shards(sources, shard_bytes: int) -> list[list]:
    shards, cur, size = [], [], 0
    for t in sources:
        if cur and size + t.nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    if cur:
        shards.append(cur)
    return shards


def _write_shard(path: Path, tensors) -> int:
    """A safetensors file: 8-byte header length, the JSON header (padded to 8 bytes), then each tensor's bytes
    streamed from its pieces."""
    header, pos = {"__metadata__": {"format": "pt"}}, 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    handles: dict = {}
    try:
        with open(path, "wb") as out:
            out.write(len(blob).to_bytes(8, "little"))
            out.write(blob)
            for t in tensors:
                for p in t.pieces:
                    f = handles.get(p.file) or handles.setdefault(p.file, open(p.file, "rb"))
                    f.seek(p.offset)
                    left = p.nbytes
                    while left:
                        chunk = f.read(min(CHUNK, left))
                        if not chunk:
                            raise HfscaleError(f"{p.file} ended early: the checkpoint is truncated")
                        out.write(chunk)
                        left -= len(chunk)
    finally:
        for f in handles.values():
            f.close()
    return 8 + len(blob) + pos


def export(ckpt: str | os.PathLike, out: str | os.PathLike, shard_bytes: int = DEFAULT_SHARD, force: bool = False,
           check: bool = True) -> ExportResult:
    """Write `out`: a transformers directory (config.json, sharded fp32 safetensors + index) from a recipe checkpoint.
    `check`: refuse a checkpoint whose files differ from its manifest."""
    from ..util.atomic import check_writable, staged
    from ..models.builtin import load_config
    from ..train.state import damage

    ckpt = Path(ckpt)
    meta = _marker(ckpt)
    check_writable({str(out): "--out"}, force, {str(ckpt): "checkpoint"})
    if _base(meta):  # an adapter-only checkpoint: no base to write a model from
        raise HfscaleError(f"{ckpt} is an adapter-only checkpoint ({_adapter(meta)}): it holds the adapter and its optimizer, "
                           f"not the base, which export needs ({_base_words(meta['base'])}); the run writes "
                           "OUTPUT_DIR/adapter and OUTPUT_DIR/model (merged into the base) at its end: resume it to the end "
                           "with --resume latest, or use those")
    if (adapter := _adapter(meta)) is not None:  # its trained tensors are the adapter's, under peft's names
        raise HfscaleError(f"{ckpt} is a checkpoint of an adapter run ({adapter}); its end is written as OUTPUT_DIR/adapter "
                           "and OUTPUT_DIR/model (merged); exporting an adapter checkpoint is not supported yet: use those, or "
                           "accelerate's load_state on the recipe's model in your own script")
    if check and (why := damage(ckpt, meta)) is not None:
        raise HfscaleError(f"checkpoint {ckpt} is damaged ({why}); export another checkpoint")
    sources = _sources(ckpt)
    if not meta.get("model"):
        raise HfscaleError(f"{ckpt}'s marker names no model, so no config.json can be written; export a recipe checkpoint")
    config = load_config(meta["model"])
    shards = _plan_shards(sources, shard_bytes)
    n = len(shards)
    total = 0
    with staged(out, directory=True) as stage:
        config.save_pretrained(stage)
        weight_map = {}
        for i, tensors in enumerate(shards):
            name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            total += _write_shard(stage / name, tensors)
            weight_map.update({t.name: name for t in tensors})
        index = {"metadata": {"total_size": sum(t.nbytes for t in sources)}, "weight_map": weight_map}
        (stage / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return ExportResult(str(out), len(sources), n, total)


def parse_size(text: str) -> int:
    """'2GB', '500MB', '1GiB', '123' -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if unit not in units or not (value > 0 and math.isfinite(value)) or value * units[unit] < 1:
        raise HfscaleError(f"--shard-size {text!r} not understood; use e.g. 2GB, 500MB or 1GiB")
    return int(value * units[unit])
