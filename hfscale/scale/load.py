"""Reading a ScaleSpec from a YAML/JSON file: strict, every unknown key is an error with a suggestion."""

from __future__ import annotations

import difflib
import json
from dataclasses import fields
from pathlib import Path

import yaml

from ..errors import ConfigError, HfscaleError, first_line
from .spec import Aio, Fsdp, Launch, Parallel, ScaleSpec, Zero

_NESTED = {"zero": Zero, "launch": Launch, "aio": Aio, "parallel": Parallel, "fsdp": Fsdp}


def _build(cls, data, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'spec'} must be a mapping (got {type(data).__name__})")
    names = [f.name for f in fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown key {where + '.' if where else ''}{key}{hint}")
        if key in _NESTED:
            value = _build(_NESTED[key], value, f"{where}.{key}" if where else key)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field missing
        raise ConfigError(f"{where or 'spec'}: {e}") from None


def spec_from_dict(data: dict) -> ScaleSpec:
    return _build(ScaleSpec, data, "")


def load_spec(path: str | Path) -> ScaleSpec:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise HfscaleError(f"cannot read {path}: {e.strerror if isinstance(e, OSError) else e}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError, RecursionError, ValueError) as e:  # RecursionError: nested too deep
        msg = first_line(e)
        raise HfscaleError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {msg}; fix its syntax") from None
    return spec_from_dict(data)


def spec_to_dict(spec: ScaleSpec) -> dict:
    """The inverse of spec_from_dict (round-trips)."""
    from dataclasses import asdict

    return asdict(spec)
