"""What the planner reads from a model's config, resolved once by transformers and kept as JSON.

`hfscale plan` without `--trace` needs a handful of numbers from a config: the `Dims` of the analytic
memory model, the attention heads per layer kind and the tensor-parallel plan (`scale.parallel.Heads`) and
the layer count. Resolving them means building transformers' config class (defaults, Gemma 4's per-layer
config and KV-sharing rule), and importing transformers imports torch: about 1.7 s of a 2.5 s plan on a
2-core host. `model_shape` resolves them with transformers the first time and stores the result under
`$HFSCALE_CACHE/shapes`, keyed by the config file's bytes, the transformers version and the source of the
hfscale modules that compute a shape (`CODE`), so a repeated plan reads JSON and imports neither (a changed
file, another transformers or a changed hfscale is a new key). Hub names are not cached (they resolve
through the hub cache anyway). A cache that cannot be read or written is skipped: it only saves time.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..util.cache import cache_root, cached_json
from ..util.errors import HfscaleError
from ..models.dims import Dims, LayerDims, dims_from_config

SHAPE_FORMAT = 2  # bump when ModelShape's fields or their meaning change
CODE = ("models/builtin.py", "models/dims.py", "plan/shape.py", "scale/parallel.py")  # what computes a shape (part of the key)


@dataclass(frozen=True)
class ModelShape:
    """A config as the planner sees it. `dims` is None (and `dims_error` says why) for an architecture
    the analytic model has no formulas for; the trace (which needs the real config) covers those."""

    model_type: str
    layers: int
    heads: object  # hfscale.scale.parallel.Heads; None (and heads_error says why) for a model without attention heads
    dims: Dims | None
    dims_error: str | None = None
    heads_error: str | None = None

    def to_dict(self) -> dict:
        return {"format": SHAPE_FORMAT, "model_type": self.model_type, "layers": self.layers,
                "heads": asdict(self.heads) if self.heads else None, "dims": asdict(self.dims) if self.dims else None,
                "dims_error": self.dims_error, "heads_error": self.heads_error}

    @classmethod
    def from_dict(cls, data: dict) -> ModelShape:
        from ..scale.parallel import Heads

        if data.get("format") != SHAPE_FORMAT:
            raise ValueError("stale shape format")
        dims = None
        if data["dims"] is not None:
            raw = dict(data["dims"])
            raw["per_layer"] = tuple(LayerDims(**ld) for ld in raw["per_layer"])
            raw["layer_types"] = tuple(raw["layer_types"])
            dims = Dims(**raw)
        heads = Heads(**data["heads"]) if data["heads"] is not None else None
        return cls(data["model_type"], data["layers"], heads, dims, data["dims_error"], data["heads_error"])


def shape_of(config) -> ModelShape:
    """Resolve a transformers config (the slow path: the caller has imported transformers)."""
    from ..scale.parallel import heads

    try:
        dims, err = dims_from_config(config), None
    except HfscaleError as e:
        dims, err = None, str(e)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    mt = getattr(text, "model_type", "?")
    try:
        h, herr = heads(config), None
    except (ArithmeticError, AttributeError, TypeError, ValueError) as e:  # no attention (e.g. Mamba), or 0 heads
        h, herr = None, (f"model_type {mt!r} has no attention heads hfscale can split ({type(e).__name__}: {e}); "
                         "plan it without --sp / --tp / --cp")
    layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        raise HfscaleError(f"model config ({mt}) has num_hidden_layers={layers!r}; give a positive layer count")
    return ModelShape(mt, layers, h, dims, err, herr)


def _source_bytes(name_or_path: str) -> bytes | None:
    """The bytes a config resolves from, or None where they cannot be known without resolving (hub names)."""
    from ..models.builtin import BUILTIN, dimension_configs

    if name_or_path in BUILTIN:
        return b"builtin:" + name_or_path.encode()  # built from models/builtin.py, which is in _code_bytes
    dims = dimension_configs()
    if name_or_path in dims:
        return dims[name_or_path].read_bytes()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    # a config is a few kB: anything large (weights given as --model) is left to load_config to refuse
    return path.read_bytes() if path.is_file() and path.stat().st_size < 1 << 20 else None


def _code_bytes() -> bytes:
    """The source of what resolves a shape: a change to it is a new cache key, never a stale answer."""
    root = Path(__file__).resolve().parent.parent
    return b"".join((root / rel).read_bytes() for rel in CODE)


def _cache_path(source: bytes) -> Path:
    from importlib.metadata import version

    key = hashlib.sha256(source + _code_bytes() + json.dumps([version("transformers"), SHAPE_FORMAT]).encode()).hexdigest()[:24]
    return cache_root() / "shapes" / f"{key}.json"


def model_shape(name_or_path: str) -> ModelShape:
    """`shape_of(load_config(name_or_path))`, through the cache."""
    from ..models.builtin import load_config

    try:
        source = _source_bytes(name_or_path)
    except OSError:
        source = None  # unreadable: load_config says why, in one line
    if source is None:
        return shape_of(load_config(name_or_path))
    data = cached_json(_cache_path(source), lambda: shape_of(load_config(name_or_path)).to_dict(), ModelShape.from_dict)
    return ModelShape.from_dict(data)


__all__ = ["SHAPE_FORMAT", "ModelShape", "model_shape", "shape_of"]
