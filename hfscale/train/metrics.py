"""Per-step metrics: peak memory (CUDA peak on GPU, process peak RSS on CPU) and a JSONL log."""

from __future__ import annotations

import json
import os
from pathlib import Path


def peak_memory_bytes() -> tuple[int, str]:
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "peak_rss"  # Linux reports KiB


class MetricsLog:
    """Append-only JSONL (one object per line, flushed each write). After a resume, readers take the
    last record per step: `read_losses` does."""

    def __init__(self, path: str | os.PathLike, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_file() and self.path.stat().st_size:  # a line cut by a kill: the next record starts afresh
                with open(self.path, "rb+") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        f.write(b"\n")

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def read_records(path: str | os.PathLike, kind: str = "train", offset: int = 0) -> dict[int, dict]:
    """step -> the last record of `kind` for that step (a resumed run rewrites the steps it redoes); `offset`: only the
    lines written after that byte (a resumed run appends to its killed run's file: what the resume alone logged)."""
    out: dict[int, dict] = {}
    p = Path(path)
    if not p.is_file():
        return out
    with open(p, "rb") as f:
        f.seek(offset)
        text = f.read().decode()
    for line in text.splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if r.get("kind") == kind:
            out[int(r["step"])] = r
    return out
