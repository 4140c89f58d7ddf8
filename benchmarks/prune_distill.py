"""Structured pruning + distillation on the trained tiny Gemma 3, and what the smaller model buys on
device. Writes benchmarks/results/prune_distill.{json,md}.

Quality (held-out perplexity on the first 64 blocks of the built-in corpus's validation split, 8,128 tokens):
  teacher              hfscale.testing.trained.trained_tiny() (3.0M parameters, 300 steps x 16 x 128 tokens)
  pruned               hfscale.compress.prune.prune(teacher, PruneTarget(params=0.5)), no training
  pruned + distilled   --steps of KL(teacher || student), T = 1 (benchmarks/finetune.py's loop, distill=1.0)
  pruned + CE          the same steps on the data alone (no teacher): what the pruned init gives by itself
  from scratch         the same student shape, random init, the same steps and tokens on the data
  distilled -> GGUF    the distilled student exported Q4_0 (PTQ), and after --qat-steps of Q4_0 QAT
                       (hfscale.compress.qat, distilled from the fp32 student), scored in llama.cpp
Each trained arm runs at every lr of --lrs (cosine to 0, batch 8 x 128); the best of each arm is the
headline, every run is in the JSON. Share of the pruning gap recovered, in loss (log-perplexity):
  recovered = (nll_pruned - nll_distilled) / (nll_pruned - nll_teacher)

Speed (`hfscale bench`, hfscale.export.bench: each run a fresh process, runs of all artifacts
alternating, median of --runs): teacher vs student in GGUF F16 and Q4_0 (llama.cpp) and .pte 8da4w
(executorch.runtime, which takes one token per call), 1024-token prompt, 256 decoded tokens.

    nice -n 5 .venv/bin/python benchmarks/prune_distill.py [--steps 200] [--runs 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hfscale.util.atomic import write_text_atomic  # noqa: E402
from hfscale.compress.evaluate import EvalData, calibration_blocks, heldout_blocks, score  # noqa: E402
from hfscale.compress.prune import PruneTarget, describe, prune  # noqa: E402
from hfscale.compress.save import save_model_dir  # noqa: E402
from hfscale.data.corpus import load_text, packed_blocks  # noqa: E402
from hfscale.models import load_for_eval  # noqa: E402
from hfscale.testing.trained import trained_tiny  # noqa: E402

from finetune import FineTune, finetune  # noqa: E402  (benchmarks/finetune.py)

ED = EvalData(n_blocks=64, seq_len=128)  # 64 x 127 = 8,128 held-out tokens, the same for transformers and llama.cpp


def nll(model, blocks) -> float:
    total, n, _ = score(model, blocks, ED.batch_size)
    return total / n


def row(name: str, model, blocks, **extra) -> dict:
    x = nll(model, blocks)
    return {"arm": name, "nll": x, "perplexity": math.exp(x), "params": sum(p.numel() for p in model.parameters()), **extra}


def quality(teacher_dir: str, steps: int, qat_steps: int, lrs: tuple[float, ...], work: Path) -> tuple[dict, str]:
    from transformers import AutoModelForCausalLM

    from hfscale.compress.qat import convert_qat_, prepare_qat_

    teacher, tok = load_for_eval(teacher_dir)
    blocks = heldout_blocks(tok, ED)
    train = packed_blocks(tok, load_text()["train"]["text"], ED.seq_len)
    rows = [row("teacher", teacher, blocks)]
    t0 = time.perf_counter()
    pruned, result = prune(teacher, PruneTarget(params=0.5), calibration_blocks(tok, 32, 128))
    prune_s = time.perf_counter() - t0
    rows.append(row("pruned (no training)", pruned, blocks))
    tokens = steps * 8 * ED.seq_len
    runs, best = [], {}
    for arm in ("pruned + distilled", "pruned + CE", "from scratch"):
        for lr in lrs:
            if arm == "from scratch":
                torch.manual_seed(0)
                m = AutoModelForCausalLM.from_config(pruned.config, dtype=torch.float32)
            else:
                m = copy.deepcopy(pruned)
            ft = FineTune(steps=steps, lr=lr, batch=8, distill=1.0 if arm == "pruned + distilled" else 0.0)
            sps = finetune(m, train, ft, teacher=teacher if ft.distill else None, desc=f"{arm} lr {lr:g}")
            r = row(arm, m, blocks, lr=lr, steps=steps, tokens=tokens, seconds_per_step=sps)
            runs.append(r)
            if arm not in best or r["nll"] < best[arm][0]["nll"]:
                best[arm] = (r, m)
    rows += [best[a][0] for a in ("pruned + distilled", "pruned + CE", "from scratch")]
    student = best["pruned + distilled"][1]
    student_dir = work / "student"
    save_model_dir(student, student_dir, tokenizer=tok, force=True)
    # --- Q4_0: PTQ of the distilled student, and QAT (distilled from the fp32 student), scored in llama.cpp ---
    qat = prepare_qat_(copy.deepcopy(student), "q4_0")
    finetune(qat, train, FineTune(steps=qat_steps, lr=1e-4, batch=8, distill=1.0, seed=2), teacher=student, desc="QAT q4_0")
    qat_dir = work / "student_qat"
    save_model_dir(convert_qat_(qat, "q4_0"), qat_dir, tokenizer=tok, force=True)
    gguf = {}
    for label, src in (("distilled, Q4_0 PTQ", student_dir), ("distilled, Q4_0 QAT", qat_dir)):
        gguf[label] = export_scored(str(src), work / f"{src.name}-Q4_0.gguf", "Q4_0")
    gap = rows[1]["nll"] - rows[0]["nll"]
    res = {"prune": json.loads(result.to_json()), "prune_summary": describe(result), "prune_seconds": prune_s, "eval_tokens": int(blocks[:, 1:].numel()),
           "train_tokens_per_arm": tokens, "lrs": list(lrs), "rows": rows, "runs": runs, "gguf": gguf,
           "recovered_loss_gap": {a: (rows[1]["nll"] - best[a][0]["nll"]) / gap for a in best},
           "ppl_vs_teacher": {a: best[a][0]["perplexity"] / rows[0]["perplexity"] for a in best}}
    return res, str(student_dir)


def export_scored(src: str, out: Path, qtype: str, verify: bool = True) -> dict:
    """A GGUF of `src`; with verify, its perplexity in llama.cpp over the same held-out blocks."""
    from hfscale.export import export_gguf
    from hfscale.export.evalset import EvalSet

    rec = export_gguf(src, out, qtype, force=True, verify=verify, progress=False,
                      evalset=EvalSet(n_prompts=2, ppl_blocks=ED.n_blocks, seq_len=ED.seq_len))
    v = rec.get("verification", {})
    return {"path": str(out), "bytes": rec["bytes"], "qtype": qtype,
            **({"perplexity_llama_cpp": v["perplexity"], "perplexity_transformers_fp32": v["perplexity_transformers_fp32"],
                "tokens": v["perplexity_tokens"], "top1_vs_transformers": v["vs_transformers"]["top1_agreement"]} if v else {})}


def speed(teacher_dir: str, student_dir: str, work: Path, runs: int, prompt: int, decode: int, threads: int) -> dict:
    from hfscale.export import export_pte
    from hfscale.export.bench import BenchSpec, bench, host_info, ratios

    spec = BenchSpec(prompt_tokens=prompt, decode_tokens=decode, runs=runs, threads=threads)
    arts = {}
    for who, src in (("teacher", teacher_dir), ("student", student_dir)):
        for q in ("F16", "Q4_0"):
            arts[f"{who} gguf {q}"] = export_scored(src, work / f"{who}-{q}.gguf", q, verify=False)["path"]
        export_pte(src, work / f"{who}-8da4w.pte", "8da4w", force=True, max_seq_len=prompt + decode, verify=False, progress=False)
        arts[f"{who} pte 8da4w"] = str(work / f"{who}-8da4w.pte")
    names = list(arts)
    results = dict(zip(names, bench([arts[n] for n in names], spec)))
    pairs = [("teacher gguf Q4_0", "student gguf Q4_0"), ("teacher gguf F16", "student gguf F16"),
             ("teacher pte 8da4w", "student pte 8da4w"), ("student gguf F16", "student gguf Q4_0"),
             ("teacher gguf F16", "teacher gguf Q4_0"), ("student gguf Q4_0", "student pte 8da4w")]
    return {"host": host_info(spec.n_threads), "spec": {"prompt_tokens": spec.prompt_tokens, "decode_tokens": spec.decode_tokens,
            "runs": runs, "threads": spec.n_threads},
            "results": {n: {**r.to_dict(), "artifact": Path(r.artifact).name} for n, r in results.items()},
            "ratios_b_over_a": [{"a": a, "b": b, **ratios(results[a], results[b])} for a, b in pairs]}


def markdown(res: dict) -> str:
    q, s = res["quality"], res["speed"]
    h = s["host"]
    lines = [f"# Structured pruning + distillation (tiny Gemma 3), and on-device speed\n",
             f"Host: {h['cpu']}, torch CPU capability {h['cpu_capability']} (bf16: {h['bf16']}), {h['cores_available']} "
             f"cores shared with other jobs; fp32 training. `{res['command']}`, {res['seconds'] / 60:.1f} min.\n",
             f"Pruning: {q['prune_summary']} ({q['prune_seconds']:.1f} s, calibration {q['prune']['calibration_tokens']:,} "
             f"train-split tokens). Held-out: {q['eval_tokens']:,} tokens; every trained arm saw "
             f"{q['train_tokens_per_arm']:,} tokens (best of lr {', '.join(f'{x:g}' for x in q['lrs'])}).\n",
             "| model | params | lr | held-out perplexity | x teacher |", "|---|---:|---:|---:|---:|"]
    t = q["rows"][0]["perplexity"]
    for r in q["rows"]:
        lines.append(f"| {r['arm']} | {r['params']:,} | {r.get('lr', '-')} | {r['perplexity']:.2f} | {r['perplexity'] / t:.2f} |")
    for label, g in q["gguf"].items():
        lines.append(f"| {label} -> GGUF, llama.cpp | - | - | {g['perplexity_llama_cpp']:.2f} | {g['perplexity_llama_cpp'] / t:.2f} |")
    rec = q["recovered_loss_gap"]
    lines += ["", "Share of the pruning loss gap recovered (in log-perplexity, (nll_pruned - nll_arm) / (nll_pruned - nll_teacher)): "
              + ", ".join(f"{a} {100 * v:.1f}%" for a, v in rec.items()) + ".", "",
              "All runs:", "", "| arm | lr | perplexity | s/step |", "|---|---:|---:|---:|"]
    lines += [f"| {r['arm']} | {r['lr']:g} | {r['perplexity']:.2f} | {r['seconds_per_step']:.3f} |" for r in q["runs"]]
    sp = s["spec"]
    lines += ["", f"## Speed: `hfscale bench`, prompt {sp['prompt_tokens']} tokens, decode {sp['decode_tokens']} tokens, "
              f"{sp['threads']} threads, median of {sp['runs']} fresh-process runs (min-max), all artifacts alternating", "",
              "| artifact | bytes | prefill tok/s | decode tok/s | ttft s | peak RSS MiB |", "|---|---:|---:|---:|---:|---:|"]
    for n, r in s["results"].items():
        sp_ = r["spread"]
        lines.append(f"| {n} | {r['bytes']:,} | {r['prefill_tokens_per_s']:,.0f} ({sp_['prefill_tokens_per_s']['min']:,.0f}-"
                     f"{sp_['prefill_tokens_per_s']['max']:,.0f}) | {r['decode_tokens_per_s']:,.1f} "
                     f"({sp_['decode_tokens_per_s']['min']:,.1f}-{sp_['decode_tokens_per_s']['max']:,.1f}) | "
                     f"{r['ttft_s']:.3f} | {r['peak_rss_bytes'] / 2**20:,.0f} |")
    lines += ["", f".pte prefill is {sp['prompt_tokens']} single-token calls (the exported program's only method).", "",
              "| A | B | prefill B/A | decode B/A | ttft B/A | peak RSS B/A | bytes B/A |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in s["ratios_b_over_a"]:
        lines.append(f"| {r['a']} | {r['b']} | {r['prefill_tokens_per_s']:.2f} | {r['decode_tokens_per_s']:.2f} | "
                     f"{r['ttft_s']:.2f} | {r['peak_rss_bytes']:.2f} | {r['bytes']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--qat-steps", type=int, default=100)
    p.add_argument("--lrs", default="1e-3,3e-3", help="learning rates every trained arm runs at (comma-separated)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch threads for training and runtime threads for bench "
                   "(1: the 2 cores here are shared; more threads than free cores make OpenMP spin)")
    p.add_argument("--teacher", help="a trained transformers dir (default: hfscale.testing.trained.trained_tiny())")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prune_distill"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    teacher_dir = a.teacher or str(trained_tiny())
    with tempfile.TemporaryDirectory(prefix="prune_distill-") as tmp:
        work = Path(tmp)
        q, student_dir = quality(teacher_dir, a.steps, a.qat_steps, tuple(float(x) for x in a.lrs.split(",")), work)
        write_text_atomic(a.out + ".json", json.dumps({"quality": q, "speed": "not measured yet"}, indent=1) + "\n")
        s = speed(teacher_dir, student_dir, work, a.runs, a.prompt_tokens, a.decode_tokens, a.threads)
    res = {"command": "benchmarks/prune_distill.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "seconds": time.perf_counter() - t0, "quality": q, "speed": s}
    md = markdown(res)
    for suffix, text in ((".json", json.dumps(res, indent=1) + "\n"), (".md", md)):
        write_text_atomic(a.out + suffix, text)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
