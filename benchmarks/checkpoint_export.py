"""Consolidating a ZeRO-3 checkpoint of a >1 GB model: `hfscale checkpoint export` vs DeepSpeed's zero_to_fp32.
Writes benchmarks/results/checkpoint_export.{json,md}.

1. Gemma 3 270M from its config (random weights, 268M parameters, 1.07 GB in fp32), trained one step by 2 ranks
   under ZeRO-3 (accelerate_configs/zero3.yaml, gloo on CPU), saved through hfscale's checkpoint writer
   (hfscale.train.state.Checkpoints: accelerate save_state + manifest).
2. Each exporter runs in its own fresh process, ROUNDS times, alternating: `hfscale checkpoint export` (fp32
   safetensors shards, 2 GB) and DeepSpeed's `convert_zero_checkpoint_to_fp32_state_dict` (the function the
   zero_to_fp32.py copied into every checkpoint runs; pickle .bin, since safetensors refuses the tied
   embedding). Peak RSS is the child's VmHWM (FACTS.md: ru_maxrss of a fork+exec child carries the parent's).
3. Both outputs reload in transformers; logits on the same ids are compared.

    .venv/bin/python benchmarks/checkpoint_export.py [--rounds 2] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODEL = "gemma-3-270m"

TRAIN = r'''
import sys, torch
from hfscale.models import load_config
from hfscale.scale.runtime import exit_rank, make_accelerator, make_optimizer, set_deepspeed_micro_batch
from hfscale.train.state import Checkpoints
from transformers import AutoModelForCausalLM
out = sys.argv[1]
acc = make_accelerator()
set_deepspeed_micro_batch(acc, 1)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(load_config("gemma-3-270m"))
opt = make_optimizer(acc, model, lr=1e-4)
model, opt = acc.prepare(model, opt)
ids = torch.randint(4, 1000, (1, 32), generator=torch.Generator().manual_seed(acc.process_index))
loss = model(input_ids=ids, labels=ids).loss
acc.backward(loss)
opt.step()
Checkpoints(out, keep_last=1).save(acc, 1, {"model": "gemma-3-270m", "tokens_per_step": 64})
acc.end_training()
exit_rank(0)  # as the recipes end: no interpreter finalization for gloo's threads to race
'''

MEASURE = r'''
import sys, time, contextlib, io
kind, ckpt, out = sys.argv[1:4]
t0 = time.perf_counter()
if kind == "hfscale":
    from hfscale.cli import main
    assert main(["checkpoint", "export", ckpt, "--out", out]) == 0
else:
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
    with contextlib.redirect_stdout(io.StringIO()):
        convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, tag="pytorch_model", safe_serialization=False)
wall = time.perf_counter() - t0
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(f"RESULT {wall:.2f} {hwm * 1024}")
'''


def run_child(code: str, *args, env=None) -> str:
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env or {})})
    if r.returncode:
        raise SystemExit(f"child failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r.stdout


def cpu_model() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def logits_equal(hf_dir: Path, bin_dir: Path) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_config(a.config).eval()
    sd = torch.load(next(bin_dir.glob("*.bin")), map_location="cpu", weights_only=True)
    b.load_state_dict(sd, strict=False)
    b.tie_weights()
    ids = torch.randint(4, 1000, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return float((a(ids).logits - b(ids).logits).abs().max())


def main() -> int:
    from hfscale.util.atomic import write_text_atomic
    from hfscale.proofs.engine import free_port

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="ckpt_export_"))
    work.mkdir(parents=True, exist_ok=True)
    run = work / "run"
    ckpt = run / "checkpoints" / "step_00000001"
    t0 = time.perf_counter()
    reused = ckpt.is_dir()  # a --work of an earlier run: its checkpoint is measured again
    if not reused:
        script = work / "train_one_step.py"
        script.write_text(TRAIN)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs" / "zero3.yaml"),
               "--num_processes", "2", "--num_machines", "1", "--machine_rank", "0", "--main_process_port", str(free_port()),
               str(script), str(run)]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
        if r.returncode:
            raise SystemExit(f"training failed:\n{r.stderr[-3000:]}")
    train_s = time.perf_counter() - t0 if not reused else None
    ckpt_bytes = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    rows = []
    for i in range(args.rounds):
        for kind in ("hfscale", "zero_to_fp32"):
            out = work / f"{kind}_{i}"
            subprocess.run(["rm", "-rf", str(out)])
            line = next(ln for ln in run_child(MEASURE, kind, ckpt, out).splitlines() if ln.startswith("RESULT"))
            wall, peak = line.split()[1:]
            rows.append({"exporter": kind, "round": i, "wall_s": float(wall), "peak_rss_bytes": int(peak),
                         "output_bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file())})
            print(rows[-1], flush=True)
    dlogit = logits_equal(work / "hfscale_0", work / "zero_to_fp32_0")

    def med(kind, key):
        vals = sorted(r[key] for r in rows if r["exporter"] == kind)
        return vals[len(vals) // 2]

    ratio_rss = med("hfscale", "peak_rss_bytes") / med("zero_to_fp32", "peak_rss_bytes")
    ratio_wall = med("hfscale", "wall_s") / med("zero_to_fp32", "wall_s")
    import torch

    from hfscale.export.ckpt_reader import zero_pieces

    params = sum(t.nbytes for t in zero_pieces(ckpt / "pytorch_model")[0]) // 4
    res = {"model": MODEL, "params": params, "checkpoint_bytes": ckpt_bytes, "train_one_step_s": train_s,
           "host": f"{cpu_model()}, {os.cpu_count()} cores, torch cpu capability "
                   f"{torch.backends.cpu.get_cpu_capability()}, cores shared with other jobs",
           "rows": rows, "peak_rss_ratio": ratio_rss, "wall_ratio": ratio_wall, "max_abs_dlogit": dlogit}
    out = ROOT / "benchmarks" / "results"
    write_text_atomic(out / "checkpoint_export.json", json.dumps(res, indent=1))
    md = [f"# Consolidating a ZeRO-3 checkpoint: hfscale checkpoint export vs zero_to_fp32",
          "",
          f"{MODEL} from its config (random weights), {params:,} parameters = {params * 4 / 1e9:.2f} GB in fp32, trained 1 step by 2 ranks under "
          f"ZeRO-3 (bf16, gloo, CPU) and saved by hfscale's checkpoint writer: {ckpt_bytes / 1e9:.2f} GB on disk. "
          f"Host: {res['host']}. Each exporter in a fresh process, {args.rounds} alternating rounds; peak RSS = the "
          "child's VmHWM.",
          "",
          "| exporter | round | wall s | peak RSS MiB | output MB |",
          "|---|---|---|---|---|"]
    md += [f"| {r['exporter']} | {r['round']} | {r['wall_s']:.1f} | {r['peak_rss_bytes'] / 2**20:,.0f} | "
           f"{r['output_bytes'] / 1e6:,.0f} |" for r in rows]
    md += ["", f"Median (of an even count, the larger) peak RSS, hfscale / zero_to_fp32: **{ratio_rss:.3f}x** (target <= 0.25x); wall: {ratio_wall:.2f}x.",
           f"Both outputs reloaded in transformers: max |dlogit| = {dlogit:.3g} on 16 ids.",
           "", "hfscale writes fp32 safetensors shards (2 GB, with index) streaming 16 MiB at a time from the rank files; "
           "zero_to_fp32 memory-maps the rank files, builds the whole fp32 state dict and pickles it (safetensors "
           "refuses the tied embedding there)."]
    write_text_atomic(out / "checkpoint_export.md", "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
