"""Run every CPU-capable shipped config on the real engine (2 processes + a 1-process reference) and
record what the ranks reported: world sizes, per-rank parameter and optimizer-state elements, where the
state lives, and the loss gap to the reference. Writes benchmarks/results/engine_proofs.{json,md}.

    .venv/bin/python benchmarks/engine_proofs.py                          # every config
    .venv/bin/python benchmarks/engine_proofs.py --only zero2_offload,zero3_offload   # rerun some, keep the rest

Each rank runs hfscale.proofs.engine (hfscale.proofs.engine.launch). A DeepSpeed rank's report includes its fp32 master-weight
and fp32 gradient partitions (elements and device) and the engine's own offload switches (ZeRO-1/2
`cpu_offload`, ZeRO-3 `offload_optimizer` / `offload_param`), so that benchmarks/plan_accuracy.py can check
hfscale plan's offloaded bytes, not only the Adam moments.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = ["ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "zero3_nvme"]


def row(name: str, reps: list[dict], ref: list[dict], seconds: float) -> dict:
    r = reps[0]
    out = {
        "config": name,
        "engine": r["distributed_type"],
        "accelerate/torch/deepspeed world": f"{r['accelerate_num_processes']}/{r['torch_world_size']}/{r.get('deepspeed_world_size', '-')}",
        "samples rank0/rank1": f"{len(reps[0]['sample_indices'])}/{len(reps[1]['sample_indices'])} disjoint={not set(reps[0]['sample_indices']) & set(reps[1]['sample_indices'])}",
        "param elems/rank": r["param_numel_local"],
        "param elems total": r["param_numel_full"],
        "adam exp_avg elems/rank (memory)": r.get("optimizer_state_numel_by_key", {}).get("exp_avg"),
        "optimizer": r.get("base_optimizer_class"),
        "state device": ",".join(r.get("optimizer_state_devices", [])),
        "nvme bytes/rank": r.get("nvme_bytes"),
        "losses (2 proc)": [round(x, 5) for x in r["losses"]],
        "losses (1 proc)": [round(x, 5) for x in ref[0]["losses"]],
        "max |Δloss|": max(abs(a - b) for a, b in zip(r["losses"], ref[0]["losses"])),
        "launch s (2 proc)": round(seconds, 1),
    }
    if "fp32_master_numel_local" in r:  # DeepSpeed ranks
        out.update({
            "adam exp_avg_sq elems/rank": r.get("optimizer_state_numel_by_key", {}).get("exp_avg_sq"),
            "fp32 master elems/rank": r["fp32_master_numel_local"],
            "fp32 grad elems/rank (kept)": r["fp32_grad_numel_local"],
            "offload optimizer / param (engine)": f"{r['offload_optimizer']}/{r['offload_param']}",
            "param devices": ",".join(r.get("param_devices", [])),
            "fp32 devices": ",".join(sorted(set(r["fp32_master_devices"]) | set(r["fp32_grad_devices"]))),
        })
    return out


def _write(rows: list[dict]) -> None:
    from hfscale.util.atomic import write_text_atomic

    out = ROOT / "benchmarks" / "results"
    write_text_atomic(out / "engine_proofs.json", json.dumps(rows, indent=1))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    md = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    md += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    write_text_atomic(out / "engine_proofs.md", "\n".join(md) + "\n")
    print("\n".join(md))


def main(argv: list[str] | None = None) -> int:
    import argparse

    from tqdm import tqdm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="comma-separated configs to rerun; the other rows of engine_proofs.json are kept")
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else CONFIGS
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    results = ROOT / "benchmarks" / "results" / "engine_proofs.json"
    old = {r["config"]: r for r in json.loads(results.read_text())} if args.only and results.exists() else {}
    new = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        from hfscale.cli import main as cli
        from hfscale.proofs.engine import launch

        if "zero3_nvme" in names:
            cli(["config", "zero3_nvme", "--nvme-path", str(tmp / "swap"), "--out-accelerate", str(tmp), "--out-deepspeed", str(tmp)])
        for name in tqdm(names, desc="configs"):
            cfg = tmp / "zero3_nvme.yaml" if name == "zero3_nvme" else ROOT / "accelerate_configs" / f"{name}.yaml"
            t0 = time.time()
            reps = launch(str(cfg), tmp / name, 2, timeout=1200)
            t1 = time.time()
            ref = launch(str(cfg), tmp / f"{name}_ref", 1, timeout=1200)
            new[name] = row(name, reps, ref, t1 - t0)
    _write([new.get(n) or old[n] for n in CONFIGS if n in new or n in old])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
