"""Issue 29's proof: the default `hfscale plan` (no flag) against measured training steps, beside the peers.

    .venv/bin/python benchmarks/plan_default.py       # -> benchmarks/results/plan_default.{md,json}

For each of 13 transformers causal-LM families (tiny configs from hfscale.testing.zoo, saved as a config.json so the
plan goes the way a user's does: `hfscale.plan.plan(path, ...)`, the library call behind the CLI), in a fresh
process per row:
  measured   two real training steps on the CPU (random weights, AdamW), every live tensor counted by torch's
             MemTracker (`trace.measure_steps`): the steady step's peak (step 2) and step 1's
  hfscale    `plan(config_dir, seq_len, micro_batch, precision=..., checkpointing=..., lora_rank=...)` with no
             method given (the default: the traced step, CPU kernels since no GPU hardware is planned)
  accelerate `accelerate estimate-memory`'s training estimate for the same parameter count and dtype
  DeepSpeed  estimate_zero2_model_states_mem_needs on 1 GPU (model states only)
Planned bf16 under DDP runs as accelerate runs it (autocast over fp32 weights), so its rows are measured as
"bf16-autocast". The timings are of the plan call in its process (cold trace cache) on this host.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"

# (arch, micro_batch, seq_len, planned precision, checkpointing, lora_rank)
ROWS = [
    ("gemma3", 2, 128, "fp32", "off", 0), ("gemma3", 2, 256, "bf16", "every:2", 0),
    ("gemma4", 2, 64, "fp32", "off", 0), ("gemma4", 2, 64, "bf16", "full", 0),
    ("llama", 2, 128, "fp32", "off", 0), ("llama", 2, 128, "bf16", "off", 8),
    ("qwen3", 2, 128, "bf16", "off", 0), ("qwen3", 3, 128, "fp32", "full", 0),
    ("mistral", 2, 128, "fp32", "off", 0),
    ("mixtral", 2, 64, "bf16", "off", 0), ("qwen3_moe", 2, 64, "bf16", "off", 0),
    ("gpt_neox", 2, 128, "fp32", "off", 0), ("falcon", 2, 128, "bf16", "off", 0),
    ("starcoder2", 2, 128, "fp32", "every:2", 0), ("granite", 2, 128, "bf16", "off", 0),
    ("phi3", 1, 256, "fp32", "off", 8), ("olmo2", 2, 128, "bf16", "full", 0),
]


def one_row(row: list) -> dict:
    """In a fresh process: real steps first (a second real run in one process counts one tensor fewer), then the plan."""
    from hfscale.plan import plan
    from hfscale.plan.trace import measure_steps
    from hfscale.testing.zoo import ARCHITECTURES

    arch, mb, seq, precision, ckpt, lora = row
    config = ARCHITECTURES[arch]()
    real = measure_steps(config, mb, seq, "bf16-autocast" if precision == "bf16" else precision, checkpointing=ckpt,
                         lora_rank=lora)
    with tempfile.TemporaryDirectory() as d:
        config.save_pretrained(d)
        t0 = time.perf_counter()
        p = plan(d, seq, mb, precision=precision, checkpointing=ckpt, lora_rank=lora).prediction
        seconds = time.perf_counter() - t0
    return {"real": [{k: v.bytes for k, v in s.items()} for s in real], "peak": p.peak, "peak_step1": p.peak_step1,
            "source": p.source, "not_traced": p.not_traced, "params": p.params, "trainable": p.trainable_params,
            "plan_s": seconds}


def peers(params: int, trainable: int, precision: str) -> dict:
    from accelerate.commands.estimate import estimate_training_usage
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    acc = estimate_training_usage(4 * params, "float32" if precision == "fp32" else "bfloat16")
    _, ds_gpu = estimate_zero2_model_states_mem_needs(trainable, 1, 1, cpu_offload=False)
    return {"accelerate": int(max(v for v in acc.values() if isinstance(v, (int, float)) and v > 0)), "deepspeed": int(ds_gpu)}


def run_rows() -> list[dict]:
    from tqdm import tqdm

    out = []
    for row in tqdm(ROWS, desc="architectures"):
        with tempfile.TemporaryDirectory() as cache:
            r = subprocess.run([sys.executable, __file__, "--row", json.dumps(row)], capture_output=True, text=True,
                               timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1", "HFSCALE_CACHE": cache})
        if r.returncode:
            out.append({"row": row, "error": (r.stderr.strip().splitlines() or ["?"])[-1]})
            continue
        d = json.loads(r.stdout.strip().splitlines()[-1])
        real1, real2 = d["real"]
        peak, peak1 = max(real2.values()), max(real1.values())
        pe = peers(d["params"], d["trainable"], row[3])
        out.append({"row": row, "measured": peak, "measured_step1": peak1, "hfscale": d["peak"], "hfscale_step1": d["peak_step1"],
                    "source": d["source"], "not_traced": d["not_traced"], "plan_s": round(d["plan_s"], 2), **pe,
                    "error": {"hfscale": d["peak"] / peak - 1, "hfscale_step1": (d["peak_step1"] or 0) / peak1 - 1,
                              "accelerate": pe["accelerate"] / peak - 1, "deepspeed": pe["deepspeed"] / peak - 1}})
    return out


def host() -> dict:
    import torch

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": platform.processor() or platform.machine(), "capability": torch.backends.cpu.get_cpu_capability(),
            "native_bf16": any(f in flags for f in ("avx512_bf16", "amx_bf16")), "cores": os.cpu_count(),
            "torch": torch.__version__}


def markdown(res: dict) -> str:
    h = res["host"]
    lines = [f"# The default `hfscale plan` vs measured step peaks ({len(res['rows'])} rows)", "",
             f"Host: {h['cores']} cores, torch CPU capability {h['capability']}, native bf16 {h['native_bf16']}, "
             f"torch {h['torch']}; measured with torch's MemTracker on real CPU steps; hfscale = `hfscale.plan.plan()` "
             "with no method given (the traced step); peers from the same parameter counts. "
             "Steady = step 2+ (AdamW states alive).", "",
             "| arch | micro | seq | precision | ckpt | LoRA | measured MiB | hfscale MiB | error | step 1 error | answered by "
             "| plan s (cold) | accelerate MiB (error) | DeepSpeed MiB (error) |", "|" + "---|" * 14]
    for r in res["rows"]:
        a, mb, seq, prec, ck, lora = r["row"]
        if "measured" not in r:
            lines.append(f"| {a} | {mb} | {seq} | {prec} | {ck} | {lora or '-'} | error: {r['error']} |" + " |" * 8)
            continue
        e = r["error"]
        lines.append(f"| {a} | {mb} | {seq} | {prec} | {ck} | {lora or '-'} | {r['measured'] / 2**20:.2f} | "
                     f"{r['hfscale'] / 2**20:.2f} | {100 * e['hfscale']:+.2f}% | {100 * e['hfscale_step1']:+.2f}% | "
                     f"{r['source']} | {r['plan_s']} | {r['accelerate'] / 2**20:.2f} ({100 * e['accelerate']:+.0f}%) | "
                     f"{r['deepspeed'] / 2**20:.2f} ({100 * e['deepspeed']:+.0f}%) |")
    ok = [r for r in res["rows"] if "measured" in r]
    worst = max(ok, key=lambda r: abs(r["error"]["hfscale"]))
    lines += ["", f"Worst hfscale row: {worst['row'][0]} {100 * worst['error']['hfscale']:+.2f}%; "
              f"rows within ±3%: {sum(abs(r['error']['hfscale']) <= 0.03 for r in ok)} of {len(res['rows'])}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--row":
        print(json.dumps(one_row(json.loads(sys.argv[2]))))
        return 0
    from hfscale.util.atomic import write_text_atomic

    res = {"host": host(), "rows": run_rows()}
    write_text_atomic(OUT / "plan_default.json", json.dumps(res, indent=1))
    write_text_atomic(OUT / "plan_default.md", markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
