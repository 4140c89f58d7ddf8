"""DDP, ZeRO-2, ZeRO-3 and FSDP2 side by side: the same recipe, model, batch and precision on 2 CPU processes, in one
run of this script (so the ratios compare runs on the same host at the same time).

    .venv/bin/python benchmarks/fsdp2_engines.py        # -> benchmarks/results/fsdp2_engines.{md,json}

Each engine trains recipes/train_clm.py (tiny Gemma 3, 4 micro x 2 accum x 2 ranks x 128 = 2,048 tokens/step,
checkpointing off, the host's precision: bf16 where native) for STEPS steps with --profile-memory 3: per rank the
steady MemTracker peak of step 3 (parameters, gradients, optimizer states, activations, engine buffers; DDP's
buckets from DDP's own logging) and the plan's prediction for it; tokens/s is the median of the steps after the
profiled ones. The engines run in ROUNDS interleaved rounds, so a slow spell of the shared host hits all of them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
ENGINES = ["ddp", "zero2", "zero3", "fsdp2"]
STEPS, PROFILED, ROUNDS = 14, 3, 2
ARGS = ["--seq-len", "128", "--global-batch-tokens", "2048", "--micro-batch", "4", "--checkpointing", "off",
        "--eval-every", "0", "--eval-blocks", "8", "--save-every", "0", "--progress", "false", "--max-train-blocks", "800",
        "--warmup-steps", "2", "--max-steps", str(STEPS), "--profile-memory", str(PROFILED)]


def run_engine(name: str, tmp: Path) -> dict:
    from hfscale.proofs.engine import free_port
    from hfscale.train.metrics import read_records

    out = tmp / name
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs" / f"{name}.yaml"),
           "--num_processes", "2", "--num_machines", "1", "--machine_rank", "0", "--main_process_port", str(free_port()),
           str(ROOT / "recipes" / "train_clm.py"), "--config", str(ROOT / "recipes" / "tiny" / "train.yaml"),
           "--output-dir", str(out), *ARGS]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    if r.returncode:
        return {"engine": name, "error": (r.stderr.strip().splitlines() or ["?"])[-1][:300]}
    train = read_records(out / "metrics.jsonl")
    prof = json.loads((out / "memory" / "profile.json").read_text())
    ranks = [{"rank": rk["rank"], "measured_peak": rk["measured"]["peak"],
              "predicted_peak": (rk.get("predicted") or {}).get("peak"),
              "error": (rk.get("error") or {}).get("peak")} for rk in prof["ranks"]]
    return {"engine": name, "seconds": time.time() - t0, "precision": prof["ranks"][0]["precision"],
            "tokens_per_s": statistics.median(train[s]["tokens_per_s"] for s in train if s > PROFILED + 1),
            "final_loss": train[STEPS]["loss"], "ranks": ranks}


def host() -> dict:
    import platform

    import torch

    flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0] if Path("/proc/cpuinfo").exists() else ""
    return {"cores": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "bf16_flags": " ".join(f for f in ("avx512_bf16", "amx_bf16") if f in flags), "python": platform.python_version()}


def markdown(res: dict) -> str:
    h = res["host"]
    lines = ["# DDP / ZeRO-2 / ZeRO-3 / FSDP2 on 2 CPU processes (benchmarks/fsdp2_engines.py)\n",
             f"Host: {h['cores']} cores shared with other jobs, torch CPU capability {h['cpu_capability']}, bf16 flags "
             f"{h['bf16_flags'] or 'none'}, torch {h['torch']}. recipes/train_clm.py, tiny Gemma 3, 4 micro x 2 accum x 2 ranks "
             f"x 128 = 2,048 tokens/step, checkpointing off; {ROUNDS} interleaved rounds, tokens/s = median of steps "
             f"{PROFILED + 2}-{STEPS} per run, memory = MemTracker steady peak per rank (step {PROFILED}).\n",
             "| engine | precision | tokens/s (per round) | vs DDP | per-rank peak MiB (rank 0 / 1) | vs DDP | plan's error (rank 0 / 1) | final loss |",
             "|---|---|---|---|---|---|---|---|"]
    by = {}
    for r in res["runs"]:
        by.setdefault(r["engine"], []).append(r)
    base = by.get("ddp", [])
    base_tps = statistics.median(r["tokens_per_s"] for r in base if "error" not in r) if base else None
    base_mem = max(rk["measured_peak"] for r in base if "error" not in r for rk in r["ranks"]) if base else None
    for name in ENGINES:
        runs = [r for r in by.get(name, []) if "error" not in r]
        if not runs:
            lines.append(f"| {name} | error: {by.get(name, [{}])[0].get('error', '?')} |||||||")
            continue
        tps = statistics.median(r["tokens_per_s"] for r in runs)
        ranks = runs[-1]["ranks"]
        peak = max(rk["measured_peak"] for rk in ranks)
        errs = " / ".join("-" if rk["error"] is None else f"{rk['error']:+.2%}" for rk in ranks)
        each = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in runs)
        mibs = " / ".join(f"{rk['measured_peak'] / 2**20:.1f}" for rk in ranks)
        lines.append(f"| {name} | {runs[0]['precision']} | {tps:,.0f} ({each}) | {tps / base_tps:.2f}x | {mibs} | "
                     f"{peak / base_mem:.2f}x | {errs} | {runs[-1]['final_loss']:.3f} |")
    lines.append(f"\nWall time: {res['seconds']:.0f} s.")
    if res.get("note"):
        lines.append(f"\n{res['note']}.")
    return "\n".join(lines) + "\n"


def main() -> int:
    from hfscale.util.atomic import write_text_atomic

    t0 = time.time()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(ROUNDS):
            for name in ENGINES:
                runs.append(run_engine(name, Path(tmp)))
                print(json.dumps(runs[-1])[:300], flush=True)
                import shutil

                shutil.rmtree(Path(tmp) / name, ignore_errors=True)
    res = {"host": host(), "runs": runs, "seconds": time.time() - t0}
    write_text_atomic(OUT / "fsdp2_engines.json", json.dumps(res, indent=1))
    write_text_atomic(OUT / "fsdp2_engines.md", markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
