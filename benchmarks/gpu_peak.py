"""Issue 17 item 5, for a host with a CUDA GPU: the plan's step peak against `torch.cuda.max_memory_allocated`
of real steps (one GPU, bf16), through `hfscale profile` (which records both per phase on CUDA).

    .venv/bin/python benchmarks/gpu_peak.py        # -> benchmarks/results/gpu_peak.{md,json}; ~5 min on an H100

Rows: the built-in tiny Gemma 3 and a Gemma 3 1B-shaped model (random weights, hfscale's shipped shape), plain
accelerate (ZeRO-0), DeepSpeed ZeRO-2 and ZeRO-3 on one process, checkpointing off / full. Without a CUDA
device it says so and exits 0 (nothing is written). Not run yet: no GPU has been lent to this project.
On CUDA, `hfscale profile` predicts with the CUDA attention kernels modelled from their fake implementations
(hfscale/plan/kernels.py, never compared with a GPU run before this script), and MemTracker counts tensors, not
the caching allocator's blocks: both gaps are what this measures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
# (model, accelerate config or None for a plain process, checkpointing, micro batch, seq len)
ROWS = [("tiny-gemma3", None, "off", 4, 256), ("tiny-gemma3", "zero2", "off", 4, 256), ("tiny-gemma3", "zero3", "full", 4, 256),
        ("gemma-3-1b", None, "off", 1, 1024), ("gemma-3-1b", None, "full", 2, 1024),
        ("gemma-3-1b", "zero2", "full", 2, 1024), ("gemma-3-1b", "zero3", "full", 2, 1024)]


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_peak: no CUDA device on this host: nothing measured, nothing written")
        return 0
    from hfscale.util.atomic import write_text_atomic

    t0, rows = time.time(), []
    for model, config, ckpt, mb, seq in ROWS:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "hfscale", "profile", "--model", model, "--steps", "3", "--micro-batch", str(mb),
                   "--seq-len", str(seq), "--checkpointing", ckpt, "--precision", "bf16", "--out", f"{tmp}/p"]
            if config:
                cmd += ["--config", str(ROOT / "accelerate_configs" / f"{config}.yaml"), "--num-processes", "1"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if r.returncode:
                rows.append({"model": model, "config": config, "checkpointing": ckpt, "error": r.stderr.strip()[-300:]})
                continue
            doc = json.loads(Path(f"{tmp}/p/profile.json").read_text())
            rank = json.loads(Path(f"{tmp}/p/ranks/rank0.json").read_text())
        last = rank["phases"][-1]
        cuda_peak = max(p.get("cuda_max_allocated", 0) for p in last.values())
        cuda_step1 = max(p.get("cuda_max_allocated", 0) for p in rank["phases"][0].values())
        reserved = max(p.get("cuda_max_reserved", 0) for p in last.values())
        row = doc["ranks"][0]
        pred = row.get("predicted") or {}
        rows.append({"model": model, "config": config or "plain", "checkpointing": ckpt, "micro_batch": mb, "seq_len": seq,
                     "cuda_max_allocated": cuda_peak, "cuda_max_allocated_step1": cuda_step1, "cuda_max_reserved": reserved,
                     "memtracker_peak": row["measured"]["peak"], "predicted_peak": pred.get("peak"),
                     "predicted_peak_step1": pred.get("peak_step1"),
                     "error_vs_allocated": (pred["peak"] / cuda_peak - 1) if pred.get("peak") and cuda_peak else None})
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows, "seconds": time.time() - t0}
    lines = [f"# Step peak on {res['device']}: plan vs max_memory_allocated (benchmarks/gpu_peak.py)\n",
             "| model | config | ckpt | micro x seq | max allocated MiB | predicted | err | step 1 allocated | predicted | max reserved |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['config']} | {r['checkpointing']} | error: {r['error'][:120]} |||||||")
            continue
        mib = lambda n: f"{n / 2**20:.1f}" if n else "-"  # noqa: E731
        err = f"{r['error_vs_allocated']:+.2%}" if r["error_vs_allocated"] is not None else "-"
        lines.append(f"| {r['model']} | {r['config']} | {r['checkpointing']} | {r['micro_batch']}x{r['seq_len']} | "
                     f"{mib(r['cuda_max_allocated'])} | {mib(r['predicted_peak'])} | {err} | {mib(r['cuda_max_allocated_step1'])} | "
                     f"{mib(r['predicted_peak_step1'])} | {mib(r['cuda_max_reserved'])} |")
    write_text_atomic(OUT / "gpu_peak.json", json.dumps(res, indent=1))
    write_text_atomic(OUT / "gpu_peak.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
