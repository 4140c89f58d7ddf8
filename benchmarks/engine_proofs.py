"""Run every CPU-capable shipped config on the real engine (2 processes + a 1-process reference) and
record what the ranks reported: world sizes, per-rank parameter and optimizer-state elements, where the
state lives, and the loss gap to the reference. Writes benchmarks/results/engine_proofs.{json,md}.

    .venv/bin/python benchmarks/engine_proofs.py                          # every config
    .venv/bin/python benchmarks/engine_proofs.py --only zero2_offload,zero3_offload   # rerun some, keep the rest

Each rank runs hfscale.proof (via this file's --worker mode) with one addition on the benchmark side: beside
what hfscale.proof reports, a DeepSpeed rank also reports its fp32 master-weight partition and fp32 gradient
partition (elements and device) and the engine's own offload switches (ZeRO-1/2 `cpu_offload`, ZeRO-3
`offload_optimizer` / `offload_param`), so that benchmarks/plan_accuracy.py can check hfscale plan's
offloaded bytes, not only the Adam moments.
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
sys.path.insert(0, str(ROOT))

CONFIGS = ["ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "zero3_nvme"]


def _fp32_holdings(engine) -> dict:
    """The fp32 partition the optimizer steps on (ZeRO-1/2: single_partition_of_fp32_groups, ZeRO-3:
    fp32_partitioned_groups_flat) and its .grad, which DeepSpeed keeps allocated on the offload device when
    the optimizer is offloaded (and frees after every step otherwise)."""
    opt = engine.optimizer
    flats = list(getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_partitioned_groups_flat", None) or [])
    grads = [t.grad for t in flats if t.grad is not None]
    return {
        "fp32_master_numel_local": sum(t.numel() for t in flats),
        "fp32_master_devices": sorted({str(t.device) for t in flats}),
        "fp32_grad_numel_local": sum(g.numel() for g in grads),
        "fp32_grad_devices": sorted({str(g.device) for g in grads}),
        "offload_optimizer": bool(getattr(opt, "cpu_offload", False) or getattr(opt, "offload_optimizer", False)),
        "offload_param": bool(getattr(opt, "offload_param", False)),
    }


def worker(argv: list[str]) -> int:
    """Under `accelerate launch`: hfscale.proof's rank program, its DeepSpeed report extended by _fp32_holdings."""
    import hfscale.proof as proof

    original = proof._zero_holdings

    def holdings(engine, model):
        return {**original(engine, model), **_fp32_holdings(engine)}

    proof._zero_holdings = holdings
    return proof.main(argv)


def launch(config: str, out: Path, num_processes: int, timeout: float = 1200) -> list[dict]:
    """hfscale.proof.launch with this file's --worker as the rank program (same command line otherwise)."""
    from hfscale.errors import HfscaleError
    from hfscale.proof import free_port

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // num_processes)))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", str(num_processes),
           "--main_process_port", str(free_port()), "--num_machines", "1", "--machine_rank", "0",
           str(Path(__file__).resolve()), "--worker", "--out", str(out)]
    log = out / "launch.log"
    with open(log, "w") as logf:
        code = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if code:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if "Error" in ln or "error:" in ln]
        raise HfscaleError(f"accelerate launch exited {code} for {config}: {(tail or ['see ' + str(log)])[-1].strip()[:300]}")
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"), key=lambda p: int(p.stem[4:]))]
    if len(reports) != num_processes:
        raise HfscaleError(f"expected {num_processes} rank reports in {out}, found {len(reports)}")
    return reports


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
    if "fp32_master_numel_local" in r:  # DeepSpeed ranks (this file's worker)
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
    from hfscale.atomic import write_text_atomic

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

        if "zero3_nvme" in names:
            cli(["config", "zero3_nvme", "--nvme-path", str(tmp / "swap"), "--out-accelerate", str(tmp), "--out-deepspeed", str(tmp)])
        for name in tqdm(names, desc="configs"):
            cfg = tmp / "zero3_nvme.yaml" if name == "zero3_nvme" else ROOT / "accelerate_configs" / f"{name}.yaml"
            t0 = time.time()
            reps = launch(str(cfg), tmp / name, 2)
            t1 = time.time()
            ref = launch(str(cfg), tmp / f"{name}_ref", 1)
            new[name] = row(name, reps, ref, t1 - t0)
    _write([new.get(n) or old[n] for n in CONFIGS if n in new or n in old])
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv[1:]:
        sys.exit(worker([a for a in sys.argv[1:] if a != "--worker"]))
    raise SystemExit(main())
