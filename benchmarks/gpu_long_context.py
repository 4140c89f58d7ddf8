"""Issue 28, for a host with a CUDA GPU: the longest sequence one GPU trains with ALST's levers, against the plan.

    .venv/bin/python benchmarks/gpu_long_context.py [--model gemma-3-1b] [--levers all|none] [--step 4096]
        # -> benchmarks/results/gpu_long_context.{md,json}

One process, random weights from the model's config (a shipped shape name, a config.json or a model directory),
bf16 weights with fp32 master weights and AdamW states (DeepSpeed's bf16 layout, hfscale.plan.trace's optimizer),
sdpa, full checkpointing, micro batch 1, and with --levers all ALST's three levers and the tiled RMSNorm at the
plan's slices (hfscale.plan.long_context.alst_levers). Each trial is two training steps in a fresh process: the sequence doubles
from --step until a step runs out of memory, then bisects in multiples of --step; each trial reports
torch.cuda.max_memory_allocated. The plan: `longest_sequence` for the same strategy and this GPU's memory, and its
per-trial total (x 1.1 fragmentation + 0.5 GiB context). Without a CUDA device it says so and exits 0 (nothing is
written). Never run yet: no GPU has been lent to this project.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"


def _strategy(seq: int):
    from hfscale.plan.memory import Strategy

    return Strategy(zero=0, precision="bf16", checkpointing="full", micro_batch=1, seq_len=seq)


def _levers(d, seq: int, which: str):
    from hfscale.plan.long_context import alst_levers
    from hfscale.scale.long_context import Levers

    return alst_levers(d, _strategy(seq)) if which == "all" else Levers()


def trial(model: str, seq: int, which: str) -> dict:
    """Two training steps at `seq` tokens; {"ok", "peak", "seconds"} (ok False on CUDA out of memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hfscale.scale.checkpointing import apply_checkpointing_
    from hfscale.models import load_config
    from hfscale.models.dims import dims_from_config
    from hfscale.plan.trace import _Optimizer
    from hfscale.scale.long_context import apply_levers_, with_levers

    config = load_config(model)
    levers = _levers(dims_from_config(config), seq, which)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).train()
    apply_checkpointing_(m, "full")
    apply_levers_(m, levers)
    opt = _Optimizer(m, "bf16")
    loss_fn = with_levers(lambda mm, b: mm(input_ids=b, labels=b).loss, levers, m)
    ids = torch.randint(0, config.get_text_config().vocab_size, (1, seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        for _ in range(2):
            loss_fn(m, ids).backward()
            opt.step()
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        return {"ok": False, "peak": torch.cuda.max_memory_allocated(), "seconds": time.perf_counter() - t0}
    return {"ok": True, "peak": torch.cuda.max_memory_allocated(), "seconds": time.perf_counter() - t0,
            "host_bytes": getattr(getattr(loss_fn, "offload", None), "host_bytes", 0)}


def _run(model, seq, which) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    r = subprocess.run([sys.executable, __file__, "--trial", model, str(seq), which], capture_output=True, text=True,
                       env=env, timeout=3600)
    lines = r.stdout.strip().splitlines()
    return json.loads(lines[-1]) if r.returncode == 0 and lines else {"ok": False, "peak": 0, "error": r.stderr[-300:]}


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma-3-1b")
    p.add_argument("--levers", choices=["all", "none"], default="all")
    p.add_argument("--step", type=int, default=4096)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_long_context: no CUDA device on this host: nothing measured, nothing written")
        return 0
    from hfscale.util.atomic import write_text_atomic
    from hfscale.models import load_config
    from hfscale.models.dims import dims_from_config
    from hfscale.plan.long_context import lever_prediction, longest_sequence
    from hfscale.plan.planner import Hardware, peak_bytes

    d = dims_from_config(load_config(args.model))
    gpu_mem = torch.cuda.get_device_properties(0).total_memory
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # host memory for the offloaded activations
    planned = longest_sequence(d, Hardware(1, 1, gpu_mem, ram), _strategy, lambda dd, s: _levers(dd, s.seq_len, args.levers),
                               step=args.step)
    trials, seq, good, bad = [], args.step, 0, None
    while bad is None and seq <= 2**23:  # double until a step does not fit
        t = _run(args.model, seq, args.levers)
        trials.append({"seq": seq, **t})
        good, bad = (seq, None) if t["ok"] else (good, seq)
        seq *= 2
    while bad is not None and bad - good > args.step:  # bisect in multiples of step
        mid = (good + bad) // 2 // args.step * args.step
        t = _run(args.model, mid, args.levers)
        trials.append({"seq": mid, **t})
        good, bad = (mid, bad) if t["ok"] else (good, mid)
    for t in trials:
        t["planned_peak"] = peak_bytes(lever_prediction(d, _strategy(t["seq"]), _levers(d, t["seq"], args.levers)).total)
    res = {"gpu": torch.cuda.get_device_name(0), "gpu_mem": gpu_mem, "model": args.model, "levers": args.levers,
           "longest_measured": good, "longest_planned": planned, "trials": trials}
    lines = [f"# Longest sequence on one {res['gpu']} ({gpu_mem / 1e9:.0f} GB): {args.model}, levers {args.levers}", "",
             f"measured {good:,} tokens; planned {planned:,} ({(planned - good) / max(good, 1):+.1%})", "",
             "| seq | fits | max allocated GB | planned GB | s |", "|---|---|---|---|---|"]
    lines += [f"| {t['seq']:,} | {t['ok']} | {t['peak'] / 1e9:.2f} | {t['planned_peak'] / 1e9:.2f} | {t.get('seconds', 0):.1f} |"
              for t in sorted(trials, key=lambda t: t["seq"])]
    OUT.mkdir(parents=True, exist_ok=True)
    write_text_atomic(OUT / "gpu_long_context.json", json.dumps(res, indent=1))
    write_text_atomic(OUT / "gpu_long_context.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--trial":
        print(json.dumps(trial(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
        sys.exit(0)
    sys.exit(main())
