"""The demo on the embedded default: write a config set, prove ZeRO-2 and ZeRO-3 training of the tiny
Gemma 3 on 2 CPU processes, plan a 27B job, then start from the shipped trained tiny model: QAT on llama.cpp's
Q4_0 grid with the recipe (float / PTQ / QAT perplexity), GGUF export checked in llama.cpp and a greedy sample.
Third-party output goes to logs under the output directory; what is printed is hfscale's."""

from __future__ import annotations

import time
from pathlib import Path


_START = [time.time()]  # run_demo's start: each banner says how far in it is


def _banner(text: str) -> None:
    print(f"\n=== {text} === [{time.time() - _START[0]:.0f} s]", flush=True)


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


# the demo's QAT: the shipped trained model on llama.cpp's Q4_0 grid, the tied embedding / head included (the GGUF
# stores it at Q4_0 too; linears alone lose almost nothing on this model), taught by the model it starts from
# (distill 1.0): the fine-tune aims at the starting model, so "recovered" against the start measures the grid, not
# extra training (benchmarks/compress.py separates those with a control run instead). fp32: the grid's effect on
# the logits (KL 0.0015 to the float model) is below bf16's rounding (KL 0.036 measured in bf16), which a bf16 run
# would fit instead. lr 3e-5: measured in one process, 24 steps x 2,048 tokens recovered 65% at 3e-5, 31% at 1e-4,
# and made it worse at 1e-3 (the weights wander across whole grid steps).
# 8 micro x 1 accum x 2 ranks x 128 = 2,048 tokens/step
QAT_ARGS = ["--scheme", "q4_0", "--include-embeddings", "true", "--distill", "1.0", "--precision", "fp32",
            "--max-steps", "24", "--lr", "3e-5", "--warmup-steps", "2", "--global-batch-tokens", "2048",
            "--micro-batch", "8", "--eval-every", "0", "--save-every", "0", "--eval-blocks", "32"]
PROMPT = "Assignment statements are used to"  # how a topic of the built-in corpus (Python's reference) begins


def trained_step(out: Path) -> Path:
    """The shipped trained tiny Gemma 3 (hfscale.models.trained), its held-out perplexity as shipped."""
    from ..models.trained import shipped_info, trained_default

    _banner("5. the trained embedded default: tiny Gemma 3 shipped trained on the built-in corpus")
    info = shipped_info()
    model_dir = trained_default()
    r = (info or {}).get("recipe", {})
    print(f"  {model_dir} (from hfscale/models/data/trained: {r.get('steps')} steps x {r.get('batch')} x "
          f"{r.get('seq_len')} tokens, tools/build_trained_tiny.py); perplexity "
          f"{info['val_ppl_first_64_blocks_shipped']:.1f} on the first 64 x 128 held-out tokens")
    return model_dir


def qat_step(out: Path, model_dir: Path, qat_args: list[str] = QAT_ARGS) -> dict:
    """recipes/qat_clm.py on 2 CPU processes (ZeRO-2) with the demo's settings; its quality.json."""
    import json

    _banner("6. QAT on llama.cpp's Q4_0 grid (recipes/qat_clm.py, 2 CPU processes, ZeRO-2): float / PTQ / QAT perplexity")
    run_dir = out / "qat_tiny"
    root = Path(__file__).resolve().parents[2]
    _launch_recipe("qat_clm.py", ["--config", str(root / "recipes/tiny/qat.yaml"), "--model", str(model_dir), *qat_args,
                                  "--output-dir", str(run_dir), "--force", "--progress", "false"], out / "qat_tiny.log")
    return json.loads((run_dir / "quality.json").read_text())


def greedy_text(gguf_path, tokenizer, prompt: str, n: int = 24) -> str:
    """`n` greedy tokens after `prompt`, computed by llama.cpp from the GGUF file (the argmax of its logits)."""
    import numpy as np

    from ..export.verify_llama import open_llama

    ids = tokenizer(prompt).input_ids
    with open_llama(Path(gguf_path), n_ctx=len(ids) + n) as llm:
        llm.reset()
        llm.eval(ids)
        new = []
        for _ in range(n):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            if tok == tokenizer.eos_token_id:
                break
            new.append(tok)
            llm.eval([tok])
    return tokenizer.decode(new)


def export_table(rows: list[dict]) -> str:
    head = ("| artifact | runtime | bytes | top-1 vs transformers | max abs dlogit | ppl (runtime) | ppl (fp32) |\n"
            "|---|---|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        v = r["verification"]
        cmp = v.get("vs_transformers") or v["vs_transformers_fp32"]
        lines.append(f"| {Path(r['out']).name} ({r['scheme']['qtype']}) | {v['runtime']} | {r['bytes']:,} | "
                     f"{cmp['top1_agreement']:.3f} | {cmp['max_abs_dlogit']:.4f} | {v['perplexity']:.2f} | "
                     f"{v['perplexity_transformers_fp32']:.2f} |")
    return "\n".join(lines)


def export_step(model_dir, out_dir, log, embed_qtype: str = "Q4_0", verify: bool = True) -> tuple[dict, str]:
    """GGUF Q4_0 of `model_dir`, checked in llama.cpp on small verification slices, and a greedy sample from it.
    What the libraries print on the way (gguf's writer bar, llama.cpp's log lines) goes to `log`. verify=False skips
    the checks (tests/test_export_gguf.py runs them) and keeps the sample."""
    from ..export.artifacts import export_gguf
    from ..export.evalset import EvalSet
    from ..models import load_tokenizer
    from ..util.quiet import output_to

    evalset = EvalSet(n_prompts=4, prompt_tokens=96, ppl_blocks=4, seq_len=128)
    with output_to(log):
        g = export_gguf(str(model_dir), Path(out_dir) / "model-Q4_0.gguf", "Q4_0", force=True, embed_qtype=embed_qtype,
                        verify=verify, evalset=evalset, progress=False)
        sample = greedy_text(g["out"], load_tokenizer(str(model_dir)), PROMPT)
    return g, sample


def run_demo(out: str = "demo_out") -> int:
    from .engine import launch, print_table, summarize
    from ..scale.files import write_config_sets
    from ..scale.presets import PRESETS

    out = Path(out).resolve()  # the recipes run from the checkout's root
    t0 = _START[0] = time.time()
    _banner("1. config set (accelerate YAML + DeepSpeed JSON), 2 processes")
    specs = [PRESETS[n].with_launch(num_processes=2) for n in ("ddp", "zero2", "zero3", "fsdp2")]
    # the demo owns demo_out/, so it rewrites its own files on every run
    for p in write_config_sets(specs, out / "accelerate_configs", out / "ds_configs", force=True):
        print(f"  wrote {p}")

    from ..doctor import check

    for spec in specs:
        errors = [f for f in check(accelerate=out / "accelerate_configs" / f"{spec.name}.yaml") if f.severity == "error"]
        print(f"  doctor {spec.name}: {'clean' if not errors else errors}")

    _banner("2. real training on 2 CPU processes (accelerate launch + DeepSpeed over gloo): ZeRO-2, ZeRO-3")
    from ..util.hosts import bf16_support, resolve_precision

    # the configs say bf16 (what GPUs run); on this CPU the tiny model runs what it computes natively
    choice = resolve_precision("auto", "bf16", bf16_support("cpu"), what="the tiny model")
    print(f"  {choice.note or 'bf16 is native on this CPU (' + bf16_support('cpu').detail + '): the configs run as written'}")
    rows, facts = [], []
    # ZeRO-2 beside its 1-process run (same model, data and steps on one rank: the losses match); ZeRO-3 builds the
    # model under zero.Init, whose initial weights differ from a plain run's, so its proof is the partitioning
    # (`hfscale prove --config accelerate_configs/zero3.yaml --reference` compares it with its own 1-process run)
    print("  zero2: 1 process (the reference), then 2 processes ...", flush=True)
    ref = launch(str(out / "accelerate_configs" / "zero2.yaml"), out / "proof" / "zero2_reference", 1, precision="auto")
    for name in ("zero2", "zero3"):
        cfg = out / "accelerate_configs" / f"{name}.yaml"
        if name != "zero2":
            print(f"  {name}: 2 processes ...", flush=True)
        reports = launch(str(cfg), out / "proof" / name, 2, precision="auto")
        rows.append(summarize(name, reports, ref if name == "zero2" else None))
        r = reports[0]
        if r["zero_stage"] == 3:
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
            f"{reports[1]['sample_indices'][:4]}...; loss {[round(x, 3) for x in r['losses']]}"
            + (f" vs 1 process {[round(x, 3) for x in ref[0]['losses']]}" if name == "zero2" else "")
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
    model_dir = trained_step(out)
    quality = qat_step(out, model_dir)
    _banner("7. edge export of the QAT model: GGUF Q4_0 (embedding too) run in llama.cpp, a greedy sample from it")
    print("  writing the GGUF, then its tokenizer, logits and perplexity checked in llama.cpp ...", flush=True)
    g, sample = export_step(out / "qat_tiny" / "quantized", out / "export", out / "export.log")
    print(export_table([g]))
    text = (PROMPT + sample).rstrip().replace("\n", "\n    ")
    print(f"  llama.cpp, greedy continuation of the prompt ({len(sample)} characters):\n    {text}")
    ppl = quality["perplexity"]
    print(f"\ndemo finished in {time.time() - t0:.0f} s; Q4_0 PTQ lost {ppl['ptq'] - ppl['float']:.2f} perplexity, "
          f"QAT recovered {100 * quality['recovered']:.0f}% of it; reports under {out / 'proof'}, GGUF in {out / 'export'}"
          if quality.get("recovered") is not None else f"\ndemo finished in {time.time() - t0:.0f} s")
    return 0
