"""Issue 17's proof: the plan's step peak against measured training steps, per architecture and per ZeRO rank.

    .venv/bin/python benchmarks/step_peak.py            # -> benchmarks/results/step_peak.{md,json}

1. One process, 13 transformers families (tiny configs from hfscale.testing.zoo) in fp32 / bf16 (DeepSpeed's
   layout: bf16 weights + fp32 master) / bf16 autocast / pure bf16, checkpointing off / full / every:2,
   micro batch 1-4, LoRA, accumulation: real steps measured with torch's MemTracker
   (`trace.measure_steps`, each row in a fresh process) against `peak.step_prediction` (the plan's path:
   fake-tensor trace, depth-scaled where layers repeat). Steady peak, step-1 peak and every phase.
2. Two processes under `accelerate launch` (hfscale's shipped DDP and DeepSpeed ZeRO 1/2/3 + offload
   configs, and FSDP2 configs from `hfscale config fsdp2`): `hfscale profile` measures inside each rank; the
   prediction is the same call with zero / dp / offload / engine (FSDP2: hfscale/plan/fsdp.py).
3. Peers on the rows of 1: accelerate `estimate-memory`'s training estimate and DeepSpeed's
   estimate_zero2_model_states_mem_needs (1 GPU), which count model states only.
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

# (arch, micro_batch, seq_len, precision, checkpointing, extra)
ROWS = [
    ("gemma3", 2, 128, "fp32", "off", {}),
    ("gemma3", 4, 256, "fp32", "full", {}),
    ("gemma3", 1, 256, "bf16", "every:2", {}),
    ("gemma4", 2, 64, "bf16", "off", {}),
    ("gemma4", 2, 64, "fp32", "full", {}),
    ("llama", 2, 128, "fp32", "off", {}),
    ("llama", 4, 128, "bf16", "every:2", {}),
    ("llama", 2, 128, "bf16", "off", {"lora_rank": 8}),
    ("qwen3", 1, 128, "bf16-autocast", "off", {"grad_accum": 2}),
    ("qwen3", 3, 128, "fp32", "full", {}),
    ("mistral", 2, 128, "bf16-pure", "off", {}),
    ("mixtral", 2, 64, "bf16", "off", {}),
    ("qwen3_moe", 2, 64, "bf16", "full", {}),
    ("gpt_neox", 2, 128, "fp32", "off", {"attention": "eager"}),
    ("falcon", 2, 128, "bf16-pure", "off", {}),
    ("starcoder2", 4, 128, "fp32", "every:2", {}),
    ("granite", 2, 128, "bf16", "off", {}),
    ("phi3", 1, 256, "fp32", "off", {"lora_rank": 8}),
    ("olmo2", 2, 128, "bf16-autocast", "full", {}),
]

# shipped accelerate configs under 2 processes: (config, checkpointing, precision); bf16 runs emulated where the
# host has no native bf16 (slower, same bytes)
ZERO_ROWS = [("ddp", "off", "fp32"), ("ddp", "off", "bf16"), ("zero1", "off", "fp32"), ("zero2", "off", "fp32"),
             ("zero2", "off", "bf16"), ("zero2", "full", "fp32"), ("zero3", "off", "fp32"), ("zero3", "off", "bf16"),
             ("zero3", "every:2", "fp32"), ("zero2_offload", "off", "fp32"), ("zero3_offload", "off", "fp32")]


def plan_args(precision: str) -> tuple[str, str]:
    """(planned precision, engine) that `step_prediction` maps to the traced precision of a row."""
    return {"bf16": ("bf16", "deepspeed"), "bf16-autocast": ("bf16", "ddp")}.get(precision, (precision, "ddp"))


def one_row(row: list) -> dict:
    """Run in a fresh process: real steps first (a second real run in one process counts one tensor fewer)."""
    from hfscale.plan.peak import step_prediction
    from hfscale.plan.trace import measure_steps
    from hfscale.testing.zoo import ARCHITECTURES

    arch, mb, seq, precision, ckpt, extra = row
    config = ARCHITECTURES[arch]()
    t0 = time.perf_counter()
    real = measure_steps(config, mb, seq, precision, checkpointing=ckpt, **extra)
    t_real = time.perf_counter() - t0
    planned, engine = plan_args(precision)
    t0 = time.perf_counter()
    pred = step_prediction(config, mb, seq, planned, extra.get("attention", "sdpa"), ckpt, extra.get("lora_rank", 0),
                           extra.get("grad_accum", 1), engine=engine)
    t_pred = time.perf_counter() - t0
    params = sum(v for v in [pred["params"]])
    return {"real": [{k: v.bytes for k, v in s.items()} for s in real], "pred": pred, "params": params,
            "trainable": pred["trainable_params"], "real_s": t_real, "predict_s": t_pred}


def peers(params: int, trainable: int, precision: str) -> dict:
    from accelerate.commands.estimate import estimate_training_usage
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    bytes_fp32 = 4 * params
    acc = estimate_training_usage(bytes_fp32, "float32" if precision == "fp32" else "bfloat16")
    _, ds_gpu = estimate_zero2_model_states_mem_needs(trainable, 1, 1, cpu_offload=False)
    return {"accelerate": int(max(v for v in acc.values() if isinstance(v, (int, float)) and v > 0)), "deepspeed": int(ds_gpu)}


def zero_peers(stage: int, offload: bool, precision: str) -> dict:
    """accelerate's and DeepSpeed's estimates for the tiny Gemma on 2 ranks (model states only)."""
    from accelerate.commands.estimate import estimate_training_usage
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from hfscale.models import build_model

    model = build_model("tiny-gemma3")
    P = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    acc = estimate_training_usage(4 * P, "float32" if precision == "fp32" else "bfloat16")
    if stage == 3:
        _, gpu, _ = estimate_zero3_model_states_mem_needs(P, largest, 2, 1, cpu_offload=offload, cpu_offload_params=offload)
    else:
        _, gpu = estimate_zero2_model_states_mem_needs(P, 2, 1, cpu_offload=offload)
    return {"accelerate": int(max(v for v in acc.values() if isinstance(v, (int, float)) and v > 0)), "deepspeed": int(gpu)}


def run_rows() -> list[dict]:
    from tqdm import tqdm

    out = []
    for row in tqdm(ROWS, desc="architectures"):
        r = subprocess.run([sys.executable, __file__, "--row", json.dumps(row)], capture_output=True, text=True,
                           timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if r.returncode:
            out.append({"row": row, "error": (r.stderr.strip().splitlines() or ["?"])[-1]})
            continue
        d = json.loads(r.stdout.strip().splitlines()[-1])
        real1, real2, pred = d["real"][0], d["real"][1], d["pred"]
        peak, peak1 = max(real2.values()), max(real1.values())
        entry = {"row": row, "measured": {"peak": peak, "peak_step1": peak1, "phases": real2, "phases_step1": real1},
                 "predicted": {k: pred[k] for k in ("peak", "peak_step1", "phases", "phases_step1", "peak_phase")},
                 "traced_layers": pred["trace"]["traced_layers"], "real_s": d["real_s"], "predict_s": d["predict_s"],
                 "peers": peers(d["params"], d["trainable"], row[3])}
        entry["error"] = {"peak": pred["peak"] / peak - 1, "peak_step1": pred["peak_step1"] / peak1 - 1,
                          "phase_worst": max((abs(pred["phases"][k] / real2[k] - 1) for k in real2), default=0),
                          "phase_step1_worst": max((abs(pred["phases_step1"][k] / real1[k] - 1) for k in real1), default=0)}
        out.append(entry)
    return out


def profile_rows(name: str, config: str, ckpt: str, precision: str, stage: int | None = None) -> list[dict]:
    """`hfscale profile` of one accelerate config on 2 processes: one row per rank (or one error row)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "hfscale", "profile", "--config", config, "--num-processes", "2", "--steps", "3",
               "--micro-batch", "2", "--seq-len", "128", "--checkpointing", ckpt, "--precision", precision, "--out", f"{tmp}/p"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if r.returncode:
            return [{"config": name, "checkpointing": ckpt, "precision": precision,
                     "error": (r.stderr.strip().splitlines() or ["?"])[-1]}]
        doc = json.loads(Path(f"{tmp}/p/profile.json").read_text())
    stage = doc["ranks"][0]["zero"] if stage is None else stage
    return [{"config": name, "checkpointing": ckpt, "rank": rk["rank"], "world": rk["world"],
             "precision": rk["precision"], "measured": rk["measured"], "predicted": rk.get("predicted"),
             "compared": rk.get("compared"), "compared_peak": rk.get("compared_peak"),
             "error": rk.get("error"), "invisible": rk["invisible_to_tracker"],
             "peers": zero_peers(stage, "offload" in name, precision)} for rk in doc["ranks"]]


def run_zero() -> list[dict]:
    from tqdm import tqdm

    return [row for name, ckpt, precision in tqdm(ZERO_ROWS, desc="2-process configs")
            for row in profile_rows(name, str(ROOT / "accelerate_configs" / f"{name}.yaml"), ckpt, precision)]


# FSDP2 (hfscale config fsdp2 + flags) under 2 processes, as accelerate's fsdp2_prepare_model wraps the model:
# (row name, hfscale config flags, checkpointing, precision); checkpointing is transformers' (the YAML's
# fsdp_activation_checkpointing fails on transformers' decoder layers: hfscale.scale.checkpointing.with_launch)
FSDP_ROWS = [("fsdp2", [], "off", "fp32"), ("fsdp2", [], "off", "bf16"),
             ("fsdp2 no reshard", ["--no-reshard-after-forward"], "off", "fp32"),
             ("fsdp2 offload", ["--offload-params", "cpu"], "off", "fp32"), ("fsdp2", [], "every:2", "fp32"),
             ("fsdp2", [], "full", "fp32")]


def run_fsdp() -> list[dict]:
    from tqdm import tqdm

    rows = []
    for name, flags, ckpt, precision in tqdm(FSDP_ROWS, desc="FSDP2 rows"):
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "hfscale", "config", "fsdp2", "--num-processes", "2", *flags,
                            "--out-accelerate", tmp, "--out-deepspeed", tmp], check=True, capture_output=True, cwd=ROOT)
            rows += profile_rows(name, f"{tmp}/fsdp2.yaml", ckpt, precision, stage=3)
    return rows


# the training recipe with --profile-memory: gradient accumulation (2 micro batches per step) under ZeRO-2
RECIPE_ROWS = [("zero2", "off"), ("zero2", "every:2"), ("ddp", "off")]


def run_recipe() -> list[dict]:
    from tqdm import tqdm

    from hfscale.proofs.engine import free_port

    rows = []
    for name, ckpt in tqdm(RECIPE_ROWS, desc="recipe --profile-memory"):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "accelerate_configs" / f"{name}.yaml"), "--num_processes", "2", "--num_machines", "1",
                   "--machine_rank", "0", "--main_process_port", str(free_port()), str(ROOT / "recipes" / "train_clm.py"),
                   "--config", str(ROOT / "recipes" / "tiny" / "train.yaml"), "--output-dir", f"{tmp}/run",
                   "--max-steps", "3", "--profile-memory", "3", "--seq-len", "64", "--global-batch-tokens", "512",
                   "--micro-batch", "2", "--eval-every", "0", "--save-every", "0", "--progress", "false",
                   "--checkpointing", ckpt, "--precision", "fp32"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT,
                               env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
            if r.returncode:
                rows.append({"config": name, "checkpointing": ckpt, "error": (r.stderr.strip().splitlines() or ["?"])[-1]})
                continue
            doc = json.loads(Path(f"{tmp}/run/memory/profile.json").read_text())
        for rk in doc["ranks"]:
            rows.append({"config": name, "checkpointing": ckpt, "grad_accum": 2, "rank": rk["rank"],
                         "measured": rk["measured"], "predicted": rk.get("predicted"), "error": rk.get("error")})
    return rows


def host() -> dict:
    import torch

    flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split() if Path("/proc/cpuinfo").exists() else []
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
            "bf16_flags": [f for f in flags if "bf16" in f], "machine": platform.machine(), "torch": torch.__version__}


def _mib(n) -> str:
    return f"{n / 2**20:.2f}"


def markdown(res: dict) -> str:
    h = res["host"]
    lines = ["# Step peak: plan vs measured (benchmarks/step_peak.py)\n",
             f"Host: {h['cores']} cores, torch CPU capability {h['cpu_capability']}, bf16 flags {h['bf16_flags'] or 'none'}, "
             f"torch {h['torch']}. Memory is counted by torch's MemTracker on CPU (no allocator caching); CUDA is not measured.\n",
             "## One process: 13 families, measured real steps vs `prediction` (fake-tensor trace, the plan's path)\n",
             "| arch | micro x seq | precision | checkpointing | extra | measured steady MiB | predicted | err | step 1 measured | predicted | err | worst phase err (steady / step 1) | accelerate est. | DeepSpeed est. (1 GPU) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in res["rows"]:
        arch, mb, seq, prec, ckpt, extra = e["row"]
        if "error" in e and "measured" not in e:
            lines.append(f"| {arch} | {mb}x{seq} | {prec} | {ckpt} | {extra or ''} | error: {e['error'][:80]} |||||||||")
            continue
        m, p, er, pe = e["measured"], e["predicted"], e["error"], e["peers"]
        lines.append(f"| {arch} | {mb}x{seq} | {prec} | {ckpt} | {', '.join(f'{k}={v}' for k, v in extra.items())} | "
                     f"{_mib(m['peak'])} | {_mib(p['peak'])} | {er['peak']:+.2%} | {_mib(m['peak_step1'])} | {_mib(p['peak_step1'])} | "
                     f"{er['peak_step1']:+.2%} | {er['phase_worst']:.2%} / {er['phase_step1_worst']:.2%} | "
                     f"{_mib(pe['accelerate'])} ({pe['accelerate'] / m['peak'] - 1:+.0%}) | {_mib(pe['deepspeed'])} ({pe['deepspeed'] / m['peak'] - 1:+.0%}) |")
    ok = [e for e in res["rows"] if "measured" in e]
    if ok:
        worst = max(ok, key=lambda e: abs(e["error"]["peak"]))
        worst1 = max(ok, key=lambda e: abs(e["error"]["peak_step1"]))
        lines.append(f"\nWorst steady-peak row: {worst['row'][0]} {worst['row'][3]} {worst['row'][4]} ({worst['error']['peak']:+.3%}); "
                     f"worst step-1 row: {worst1['row'][0]} {worst1['row'][3]} {worst1['row'][4]} ({worst1['error']['peak_step1']:+.3%}); "
                     f"{len(ok)}/{len(res['rows'])} rows within ±3% on the steady peak: "
                     f"{sum(abs(e['error']['peak']) <= 0.03 for e in ok)}.")
    lines += ["\n## Two processes under `accelerate launch` (shipped configs), measured inside each rank with `hfscale profile`\n",
              "| config | checkpointing | rank | precision | measured steady MiB | predicted (device [+ offloaded]) | err | step 1 measured | err | not seen by MemTracker | accelerate est. | DeepSpeed est. |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for z in res["zero"] + res.get("fsdp", []):  # FSDP2 rows: hfscale/plan/fsdp.py over the trace
        if "measured" not in z:
            lines.append(f"| {z['config']} | {z['checkpointing']} | error: {z['error'][:100]} ||||||||")
            continue
        m, p, er, pe = z["measured"], z["predicted"] or {}, z["error"] or {}, z["peers"]
        pred = _mib(p.get("peak", 0)) + (f" + {_mib(p['offloaded_per_rank'])}" if p.get("offloaded_per_rank") else "")
        lines.append(f"| {z['config']} | {z['checkpointing']} | {z['rank']}/{z['world']} | {z['precision']} | {_mib(m['peak'])} | "
                     f"{pred} | {er.get('peak', float('nan')):+.3%} | {_mib(m['peak_step1'])} | "
                     f"{er.get('peak_step1', float('nan')):+.2%} | {z['invisible'] or '-'} | "
                     f"{_mib(pe['accelerate'])} ({pe['accelerate'] / m['peak'] - 1:+.0%}) | {_mib(pe['deepspeed'])} ({pe['deepspeed'] / m['peak'] - 1:+.0%}) |")
    lines += ["\n## The recipe with `--profile-memory 3` (2 processes, 2 micro batches x 64 per step, fp32), per rank\n",
              "| config | checkpointing | rank | measured steady MiB | predicted | err | step 1 measured | err |", "|---|---|---|---|---|---|---|---|"]
    for z in res.get("recipe", []):
        if "measured" not in z:
            lines.append(f"| {z['config']} | {z['checkpointing']} | error: {z['error'][:100]} ||||")
            continue
        m, p, er = z["measured"], z["predicted"] or {}, z["error"] or {}
        lines.append(f"| {z['config']} | {z['checkpointing']} | {z.get('rank', 0)} | {_mib(m['peak'])} | {_mib(p.get('peak', 0))} | "
                     f"{er.get('peak', float('nan')):+.2%} | {_mib(m['peak_step1'])} | {er.get('peak_step1', float('nan')):+.2%} |")
    ranked = [z for z in res["zero"] + res.get("fsdp", []) + res.get("recipe", []) if "measured" in z and z.get("error")]
    if ranked:
        worst = max(ranked, key=lambda z: abs(z["error"]["peak"]))
        lines.append(f"\nTwo-process rows (both tables): {sum(abs(z['error']['peak']) <= 0.03 for z in ranked)}/{len(ranked)} "
                     f"within ±3% on the steady peak; worst: {worst['config']} {worst['checkpointing']} rank {worst.get('rank', 0)} "
                     f"({worst['error']['peak']:+.2%}).")
    lines.append(f"\nWall time: {res['seconds']:.0f} s.")
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--row":
        print(json.dumps(one_row(json.loads(sys.argv[2])), default=str))
        return 0
    from hfscale.util.atomic import write_text_atomic

    t0 = time.time()
    only = sys.argv[1] if len(sys.argv) > 1 else "all"
    old = json.loads((OUT / "step_peak.json").read_text()) if only != "all" and (OUT / "step_peak.json").exists() else {}
    res = {"host": host(), "rows": run_rows() if only in ("all", "rows") else old.get("rows", []),
           "zero": run_zero() if only in ("all", "zero") else old.get("zero", []),
           "fsdp": run_fsdp() if only in ("all", "fsdp") else old.get("fsdp", []),
           "recipe": run_recipe() if only in ("all", "recipe") else old.get("recipe", [])}
    res["seconds"] = time.time() - t0 + (old.get("seconds", 0) if only != "all" else 0)
    write_text_atomic(OUT / "step_peak.json", json.dumps(res, indent=1, default=str))
    write_text_atomic(OUT / "step_peak.md", markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
