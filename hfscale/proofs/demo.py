"""The demo on the embedded default: write a config set, prove ZeRO-2 and ZeRO-3 training of the tiny
Gemma 3 on 2 CPU processes, plan a 27B job, train with the recipe, QAT on the Q4_0 grid, export and run."""

from __future__ import annotations

import time
from pathlib import Path


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def _launch_recipe(recipe: str, args: list[str], log: Path) -> None:
    """accelerate launch RECIPE on 2 CPU processes under ZeRO-2; output to `log`, one error line on failure."""
    import os
    import subprocess
    import sys

    from ..util.errors import HfscaleError
    from .engine import free_port

    root = Path(__file__).resolve().parents[2]
    path = root / "recipes" / recipe
    if not path.is_file():
        raise HfscaleError(f"{path} not found: run the demo from a checkout of hfscale (make demo)")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(root / "accelerate_configs/zero2.yaml"),
           "--num_processes", "2", "--num_machines", "1", "--machine_rank", "0", "--main_process_port", str(free_port()),
           str(path), *args]
    print("  " + " ".join(["accelerate launch", *cmd[3:]]).replace(str(root) + "/", ""), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log.parent.mkdir(parents=True, exist_ok=True)
    tag = "[" + Path(recipe).stem + "]"
    # everything goes to the log; the recipe's own lines (batch arithmetic, precision, step N/M, tables)
    # are shown as they come, so a long step is never minutes of silence
    # from the checkout's root: the shipped accelerate configs name their DeepSpeed JSON relative to it
    with open(log, "w") as f, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=root,
                                               text=True, errors="replace") as proc:
        for line in proc.stdout:
            f.write(line)
            if line.startswith((tag, "|")):
                print("  " + line.rstrip(), flush=True)
        rc = proc.wait()
    if rc:
        raise HfscaleError(f"{recipe} failed (exit {rc}); see {log}")


def train_step(out: Path) -> Path:
    """recipes/train_clm.py on 2 CPU processes (ZeRO-2) for about a minute, then the saved model reloaded."""
    import statistics

    from ..train.metrics import read_records

    _banner("5. the training recipe: tiny Gemma 3, 2 CPU processes, ZeRO-2, checkpoints + consolidated save")
    root = Path(__file__).resolve().parents[2]
    run_dir = out / "train_tiny"
    log = out / "train_tiny.log"
    _launch_recipe("train_clm.py", ["--config", str(root / "recipes/tiny/train.yaml"), "--output-dir", str(run_dir), "--force",
                                    "--progress", "false"], log)
    train, evals = read_records(run_dir / "metrics.jsonl"), read_records(run_dir / "metrics.jsonl", "eval")
    first, last = train[min(train)], train[max(train)]
    print(f"  loss {first['loss']:.3f} -> {last['loss']:.3f} over {len(train)} steps, "
          f"{statistics.median([r['tokens_per_s'] for r in train.values()]):,.0f} tokens/s, "
          f"peak RSS {last['peak_mem_bytes'] / 2**20:.0f} MiB/rank; eval ppl "
          + " -> ".join(f"{evals[s]['ppl']:.0f} (step {s})" for s in sorted(evals)))
    print(f"  checkpoints kept: {sorted(p.name for p in (run_dir / 'checkpoints').iterdir())}")
    print("  after a crash or preemption, the same command with --resume latest continues from the newest checkpoint")
    return run_dir / "model"


def qat_and_export_step(out: Path, model_dir: Path) -> None:
    """QAT on llama.cpp's Q4_0 grid, the quality table, then GGUF Q4_0 + .pte 8da4w run in their runtimes."""
    _banner("6. QAT fine-tune on llama.cpp's Q4_0 grid (2 CPU processes, ZeRO-2), then float / PTQ / QAT perplexity")
    run_dir = out / "qat_tiny"
    root = Path(__file__).resolve().parents[2]
    log = out / "qat_tiny.log"
    _launch_recipe("qat_clm.py", ["--config", str(root / "recipes/tiny/qat.yaml"), "--model", str(model_dir), "--scheme",
                                  "q4_0", "--output-dir", str(run_dir), "--force", "--progress", "false"], log)
    _banner("7. edge export of the QAT model: GGUF Q4_0 in llama.cpp, ExecuTorch .pte (8da4w) in executorch.runtime")
    print(export_step(run_dir / "quantized", out / "export"))


def export_table(rows: list[dict]) -> str:
    head = ("| artifact | runtime | bytes | top-1 vs transformers | max abs dlogit | ppl (runtime) | ppl (fp32) | greedy = eager |\n"
            "|---|---|---:|---:|---:|---:|---:|---|")
    lines = [head]
    for r in rows:
        v = r["verification"]
        cmp = v.get("vs_transformers") or v["vs_transformers_fp32"]
        greedy = v.get("greedy", {}).get("identical")
        lines.append(f"| {Path(r['out']).name} ({r['scheme']['qtype']}) | {v['runtime']} | {r['bytes']:,} | "
                     f"{cmp['top1_agreement']:.3f} | {cmp['max_abs_dlogit']:.4f} | {v['perplexity']:.2f} | "
                     f"{v['perplexity_transformers_fp32']:.2f} | {'-' if greedy is None else greedy} |")
    return "\n".join(lines)


def export_step(model_dir, out_dir) -> str:
    """GGUF Q4_0 and .pte 8da4w of one model directory, each run in its runtime on small verification slices."""
    from ..export.artifacts import export_gguf, export_pte
    from ..export.evalset import EvalSet

    evalset = EvalSet(n_prompts=4, prompt_tokens=96, ppl_blocks=4, seq_len=128)
    out = Path(out_dir)
    g = export_gguf(str(model_dir), out / "model-Q4_0.gguf", "Q4_0", force=True, evalset=evalset)
    p = export_pte(str(model_dir), out / "model-8da4w.pte", "8da4w", force=True, n_generate=16, evalset=evalset)
    return export_table([g, p])


def run_demo(out: str = "demo_out") -> int:
    from .engine import launch, print_table, summarize
    from ..scale.files import write_config_sets
    from ..scale.presets import PRESETS

    out = Path(out).resolve()  # the recipes run from the checkout's root
    t0 = time.time()
    _banner("1. config set (accelerate YAML + DeepSpeed JSON), 2 processes")
    specs = [PRESETS[n].with_launch(num_processes=2) for n in ("ddp", "zero2", "zero3", "fsdp2")]
    # the demo owns demo_out/, so it rewrites its own files on every run
    for p in write_config_sets(specs, out / "accelerate_configs", out / "ds_configs", force=True):
        print(f"  wrote {p}")

    from ..doctor import check

    for spec in specs:
        errors = [f for f in check(accelerate=out / "accelerate_configs" / f"{spec.name}.yaml") if f.severity == "error"]
        print(f"  doctor {spec.name}: {'clean' if not errors else errors}")

    _banner("2. real training on 2 CPU processes (accelerate launch + DeepSpeed / FSDP2 over gloo)")
    from ..util.hosts import bf16_support, resolve_precision

    # the configs say bf16 (what GPUs run); on this CPU the tiny model runs what it computes natively
    choice = resolve_precision("auto", "bf16", bf16_support("cpu"), what="the tiny model")
    print(f"  {choice.note or 'bf16 is native on this CPU (' + bf16_support('cpu').detail + '): the configs run as written'}")
    rows, facts = [], []
    for name in ("zero2", "zero3", "fsdp2"):
        cfg = out / "accelerate_configs" / f"{name}.yaml"
        print(f"  {name}: 2 processes, then the 1-process reference ...", flush=True)
        reports = launch(str(cfg), out / "proof" / name, 2, precision="auto")
        ref = launch(str(cfg), out / "proof" / f"{name}_reference", 1, precision="auto")
        rows.append(summarize(name, reports, ref))
        r = reports[0]
        if r["distributed_type"] == "FSDP":
            facts.append(
                f"FSDP2: rank 0 holds {r['param_numel_local']:,} of {r['param_numel_full']:,} parameter elements "
                f"({r['params_sharded_dim0']}/{r['params_total']} tensors DTensor shards of 1/2) and "
                f"{r['optimizer_state_numel_by_key'].get('exp_avg', 0):,} per Adam moment"
            )
        elif r["zero_stage"] == 3:
            facts.append(
                f"ZeRO-3: rank 0 holds {r['param_numel_local']:,} of {r['param_numel_full']:,} parameter elements "
                f"({r['params_partitioned_evenly']}/{r['params_total']} tensors cut in half); the consolidated save "
                f"has {r['state_dict_numel']:,} elements (tied lm_head included)"
            )
        else:
            per = r["optimizer_state_numel_by_key"]
            facts.append(
                f"ZeRO-{r['zero_stage']}: each rank's Adam state is {per.get('exp_avg', 0):,} elements per moment "
                f"= half of {r['param_numel_full']:,} parameters; parameters stay whole ({r['param_numel_local']:,})"
            )
        facts.append(
            f"{name}: ranks trained on disjoint halves {reports[0]['sample_indices'][:4]}... / "
            f"{reports[1]['sample_indices'][:4]}...; loss {[round(x, 3) for x in r['losses']]} "
            f"vs 1 process {[round(x, 3) for x in ref[0]['losses']]}"
        )
    _banner("3. what the ranks reported")
    print_table(rows)
    print()
    for f in facts:
        print(f"  - {f}")
    _banner("4. planning a real job from the config alone: Gemma 3 27B, seq 4096, 2 nodes x 8 x 80 GB")
    from ..plan import Hardware, plan

    result = plan("gemma-3-27b", 4096, 1, hardware=Hardware(8, 2, 80 * 10**9), global_batch_tokens=2**20, progress=True)
    best = result.pick
    if best is None:
        print(f"  {result.nothing_fits}")
    else:
        p = best.prediction
        parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(p.breakdown.items(), key=lambda kv: -kv[1]) if v > 1e8)
        how = (f"traced on fake tensors, {p.trace['kernels']} attention kernels, peak in {p.peak_phase}"
               if p.source == "trace" else f"analytic: {p.not_traced}")
        print(f"  pick: {best.label}, accumulation {best.grad_accum}: step peak {p.peak / 1e9:.1f} GB ({parts}); with "
              f"fragmentation and CUDA context {best.peak_bytes / 1e9:.1f} GB/GPU ({how})")
    train_dir = train_step(out)
    qat_and_export_step(out, train_dir)
    print(f"\ndemo finished in {time.time() - t0:.0f} s; reports under {out / 'proof'}, trained model in {train_dir}")
    return 0
