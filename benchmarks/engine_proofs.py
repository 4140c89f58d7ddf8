"""Run every CPU-capable shipped config on the real engine (2 processes + a 1-process reference) and
record what the ranks reported: world sizes, per-rank parameter and optimizer-state elements, where the
state lives, and the loss gap to the reference. Writes benchmarks/results/engine_proofs.{json,md}.

    .venv/bin/python benchmarks/engine_proofs.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hfscale.atomic import write_text_atomic  # noqa: E402
from hfscale.proof import launch  # noqa: E402

CONFIGS = ["ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "zero3_nvme"]


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        from hfscale.cli import main as cli

        cli(["config", "zero3_nvme", "--nvme-path", str(tmp / "swap"), "--out-accelerate", str(tmp), "--out-deepspeed", str(tmp)])
        for name in tqdm(CONFIGS, desc="configs"):
            cfg = tmp / "zero3_nvme.yaml" if name == "zero3_nvme" else ROOT / "accelerate_configs" / f"{name}.yaml"
            t0 = time.time()
            reps = launch(str(cfg), tmp / name, 2)
            t1 = time.time()
            ref = launch(str(cfg), tmp / f"{name}_ref", 1)
            r = reps[0]
            rows.append({
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
                "launch s (2 proc)": round(t1 - t0, 1),
            })
    out = ROOT / "benchmarks" / "results"
    write_text_atomic(out / "engine_proofs.json", json.dumps(rows, indent=1))
    keys = list(rows[0])
    md = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    md += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    write_text_atomic(out / "engine_proofs.md", "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
