"""The JSON sidecar written next to every exported artifact (`<out>.json`): what it came from,
how it was quantized, how big it is, and what its runtime measured against the source."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..util.atomic import write_text_atomic


def sidecar_path(out: Path) -> Path:
    return Path(str(out) + ".json")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def source_info(model_name: str, model) -> dict:
    n = sum(p.numel() for p in model.parameters())  # tied weights counted once by parameters()
    return {"model": model_name, "model_type": model.config.model_type, "parameters": n,
            "fp32_bytes": 4 * n}


def write_sidecar(out: Path, record: dict) -> Path:
    rec = {"artifact": Path(out).name, "bytes": Path(out).stat().st_size, "sha256": sha256(Path(out)), **record}
    return write_text_atomic(sidecar_path(out), json.dumps(rec, indent=2, sort_keys=False) + "\n")
