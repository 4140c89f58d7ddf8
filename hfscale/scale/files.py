"""Writing a spec's config set to disk: accelerate YAML + DeepSpeed JSON, atomically, never
overwriting without force, nothing written when any check fails."""

from __future__ import annotations

import json
from pathlib import Path

from ..util.atomic import check_writable, write_text_atomic
from .accelerate import render_yaml
from .deepspeed import to_deepspeed
from .spec import ScaleSpec, check_nvme_path


def config_paths(spec: ScaleSpec, accelerate_dir: str | Path, deepspeed_dir: str | Path) -> dict[str, Path]:
    paths = {"accelerate": Path(accelerate_dir) / f"{spec.name}.yaml"}
    if spec.uses_deepspeed:
        paths["deepspeed"] = Path(deepspeed_dir) / f"{spec.name}.json"
    return paths


def render_config_set(spec: ScaleSpec, accelerate_dir, deepspeed_dir) -> dict[Path, str]:
    """{path: text} for the spec; the YAML refers to the JSON by the path as given (relative paths
    resolve against the directory `accelerate launch` runs in)."""
    paths = config_paths(spec, accelerate_dir, deepspeed_dir)
    out = {}
    ds_path = None
    if "deepspeed" in paths:
        ds_path = paths["deepspeed"]
        out[ds_path] = json.dumps(to_deepspeed(spec), indent=2) + "\n"
    out[paths["accelerate"]] = render_yaml(spec, str(paths["accelerate"]), str(ds_path) if ds_path else None)
    return out


def write_config_sets(specs, accelerate_dir, deepspeed_dir, force: bool = False, check_paths: bool = True,
                      inputs=()) -> list[Path]:
    """inputs: {path: flag} of files the configs were made from (a --spec), never overwritten."""
    rendered: dict[Path, str] = {}
    flags: dict[Path, str] = {}
    for spec in specs:
        if check_paths:
            check_nvme_path(spec)
        rendered.update(render_config_set(spec, accelerate_dir, deepspeed_dir))
        flags.update({p: f"--out-{kind}" for kind, p in config_paths(spec, accelerate_dir, deepspeed_dir).items()})
    check_writable(flags, force, inputs)  # before anything is written
    return [write_text_atomic(p, text) for p, text in rendered.items()]
