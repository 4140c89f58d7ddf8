"""Is the pruned student really faster on device? Teacher vs `hfscale prune --params 0.5x` student at a
size where per-token overhead no longer hides the work (issue 19: at the tiny 3M-vs-1.5M size speed
was equal within noise, benchmarks/results/prune_distill.md). Writes benchmarks/results/prune_speed.{json,md,png}.

Teacher: Gemma 3 270M's layer shape (hidden 640, MLP 2048, 4 query heads / 1 KV head of 256, sliding
window 512, 5:1 sliding/global) at 12 layers instead of 18, with the built-in 4,096-token vocabulary
(so the embedding does not dominate): ~69M parameters, RANDOM weights (seeded init, untrained).
Speed does not depend on what the weights are; the perplexity of this pair means nothing and is not
reported. Student: `hfscale prune TEACHER --params 0.5x` (hidden and MLP channels shrink; the layers,
heads and the sliding/global pattern stay), importance from the built-in calibration text.

Everything below runs through hfscale's own commands, as a user types them:
  hfscale prune teacher --params 0.5x --out student            (--prune-extra "--heads 2": half the query heads too)
  hfscale quantize {teacher,student} --format gguf --qtype F16|Q4_0     (llama.cpp)
  hfscale quantize {teacher,student} --format pte --qtype 8da4w --max-seq-len 1280   (ExecuTorch, XNNPACK)
  hfscale bench TEACHER_ARTIFACT --compare STUDENT_ARTIFACT --json --runs N --threads T
Each bench invocation alternates teacher and student runs (A B A B ...), each run a fresh process
(peak RSS = VmHWM of that process), and reports medians and min-max; ratios are student / teacher of
the medians measured in that same invocation.

    nice -n 5 .venv/bin/python benchmarks/prune_speed.py [--runs 5] [--threads 1] [--layers 12]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hfscale.util.atomic import staged, write_text_atomic  # noqa: E402

HFSCALE = [str(Path(sys.executable).with_name("hfscale"))]  # the console script beside this interpreter
FORMATS = (("gguf F16", "gguf", "F16"), ("gguf Q4_0", "gguf", "Q4_0"), ("pte 8da4w", "pte", "8da4w"))


def teacher_config(layers: int):
    """Gemma 3 270M's shipped dimensions with `layers` decoder layers and the built-in tokenizer's vocabulary."""
    from hfscale.models import load_config, tiny_config

    cfg = load_config("gemma-3-270m").to_dict()
    tiny = tiny_config()
    pattern = (["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6 + 1)
    cfg.update(num_hidden_layers=layers, layer_types=pattern[:layers], vocab_size=tiny.vocab_size,
               pad_token_id=tiny.pad_token_id, eos_token_id=tiny.eos_token_id, bos_token_id=tiny.bos_token_id)
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "transformers_version")})


def sh(*args, what: str) -> subprocess.CompletedProcess:
    t = time.perf_counter()
    r = subprocess.run([*HFSCALE, *map(str, args)], capture_output=True, text=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if r.returncode != 0:
        raise SystemExit(f"{what} failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    print(f"[prune_speed] {what}: {time.perf_counter() - t:.0f} s", flush=True)
    return r


def build(work: Path, layers: int, threads: int, prune_extra: tuple[str, ...] = ()) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from hfscale.compress.save import save_model_dir
    from hfscale.models import load_tokenizer

    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(teacher_config(layers), dtype=torch.float32)
    save_model_dir(teacher, work / "teacher", tokenizer=load_tokenizer("tiny-gemma3"))
    del teacher
    r = sh("prune", work / "teacher", "--out", work / "student", "--params", "0.5x", *prune_extra, "--calib-blocks", "16",
           "--json", what="hfscale prune --params 0.5x " + " ".join(prune_extra))
    return json.loads(r.stdout.strip().splitlines()[-1])


def export(work: Path, prompt: int, decode: int, formats=FORMATS) -> dict[str, dict[str, Path]]:
    arts: dict[str, dict[str, Path]] = {}
    for label, fmt, qtype in formats:
        for who in ("teacher", "student"):
            out = work / f"{who}-{qtype}.{fmt}"
            extra = ["--max-seq-len", prompt + decode] if fmt == "pte" else []
            sh("quantize", work / who, "--format", fmt, "--qtype", qtype, "--out", out, "--no-verify", *extra,
               what=f"hfscale quantize {who} --format {fmt} --qtype {qtype}")
            arts.setdefault(label, {})[who] = out
    return arts


PAIRED = ("prefill_tokens_per_s", "decode_tokens_per_s", "ttft_s")


def paired(pr: dict) -> dict:
    """Run i of the student over run i of the teacher (they ran back to back): median and min-max over i.
    On a shared host this cancels most of the load that moves both runs of a pair alike."""
    import statistics

    out = {}
    for m in PAIRED:
        rs = [b[m] / a[m] for a, b in zip(pr["a"]["per_run"], pr["b"]["per_run"])]
        out[m] = {"median": statistics.median(rs), "min": min(rs), "max": max(rs), "per_run": rs}
    return out


def bench_pair(a: Path, b: Path, runs: int, prompt: int, decode: int, threads: int) -> dict:
    r = sh("bench", a, "--compare", b, "--json", "--runs", runs, "--prompt-tokens", prompt, "--decode-tokens", decode,
           "--threads", threads, what=f"hfscale bench {a.name} --compare {b.name}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for k in ("a", "b"):
        out[k]["artifact"] = Path(out[k]["artifact"]).name
    out["paired_ratios"] = paired(out)
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("prefill_tokens_per_s", "prefill tok/s"), ("decode_tokens_per_s", "decode tok/s"),
               ("ttft_s", "TTFT"), ("peak_rss_bytes", "peak RSS"), ("bytes", "file bytes")]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(res["pairs"])
    for i, (label, p) in enumerate(res["pairs"].items()):
        xs = [j + i * width for j in range(len(metrics))]
        ax.bar(xs, [p["ratios_b_over_a"][m] for m, _ in metrics], width, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + width * (len(res["pairs"]) - 1) / 2 for j in range(len(metrics))], [n for _, n in metrics])
    ax.set_ylabel("student / teacher (median)")
    h = res["host"]
    ax.set_title(f"pruned 0.5x student vs teacher ({res['params']['teacher'] / 1e6:.0f}M), {h['cpu_capability']}, "
                 f"{res['threads']} thread(s)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with staged(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


def macs_per_token(layers: int, hidden: int, inter: int, ctx: float, vocab: int = 4096, nq: int = 4, nkv: int = 1,
                   hd: int = 256) -> float:
    """Multiply-adds one token costs: per layer q/k/v/o + the GeGLU MLP (what pruning shrinks) + attention
    over `ctx` keys, 2 x nq x hd x ctx (what it leaves alone: heads and head_dim are kept), then the lm_head."""
    linear = hidden * nq * hd + 2 * hidden * nkv * hd + nq * hd * hidden + 3 * hidden * inter
    return layers * (linear + 2 * nq * hd * ctx) + vocab * hidden


def expected(res: dict) -> dict:
    """Teacher / student multiply-adds per token: the speed-up the arithmetic allows. Prefill: llama.cpp
    computes the whole masked score matrix per 512-token batch, so the two batches of a 1,024-token prompt see
    512 and 1,024 keys (mean 768); decode sees prompt + half the decoded tokens on average."""
    b, a, n = res["prune"]["before"], res["prune"]["after"], res.get("layers", 12)
    p, d = res["prompt_tokens"], res["decode_tokens"]
    out = {}
    for name, ctx in (("prefill", (min(p, 512) + p) / 2), ("decode", p + d / 2)):
        t = macs_per_token(n, b["hidden_size"], b["intermediate_size"], ctx, nq=b["heads"])
        s = macs_per_token(n, a["hidden_size"], a["intermediate_size"], ctx, nq=a["heads"])
        out[name] = {"ctx": ctx, "teacher_macs": t, "student_macs": s, "speedup": t / s}
    return out


def markdown(res: dict, png: str = "prune_speed.png") -> str:
    h, p = res["host"], res["params"]
    lines = [f"# Is the pruned student faster on device? (Gemma 3 270M layer shape, {res.get('layers', 12)} layers, random weights)\n",
             f"Host: {h['cpu']}, torch CPU capability {h['cpu_capability']} (bf16: {h['bf16']}; native bf16: "
             f"{h['native_bf16']}), {h['cores_available']} cores (teacher and student runs alternate inside each "
             f"`hfscale bench --compare`, so load from other jobs on the host hits both). "
             f"`{res['command']}`, {res['seconds'] / 60:.1f} min.\n",
             f"Teacher: {p['teacher']:,} parameters, random seeded init (untrained: speed only, no perplexity). "
             f"Student: `{res.get('prune_command', 'hfscale prune TEACHER --params 0.5x')}`: {res['prune_summary']}.\n",
             f"Each row: `hfscale bench TEACHER --compare STUDENT --runs {res['runs']} --threads {res['threads']} "
             f"--prompt-tokens {res['prompt_tokens']} --decode-tokens {res['decode_tokens']}`; median (min-max) over "
             f"{res['runs']} fresh-process runs each.\n",
             "| format | model | bytes | threads | prefill tok/s | decode tok/s | TTFT s | peak RSS MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]

    def cell(r, m, f):
        s = r["spread"][m]
        return f"{f(r[m])} ({f(s['min'])}-{f(s['max'])})"

    mib = lambda v: f"{v / 2**20:,.0f}"  # noqa: E731
    for label, pr in res["pairs"].items():
        for who, k in (("teacher", "a"), ("student", "b")):
            r = pr[k]
            lines.append(f"| {label} | {who} | {r['bytes']:,} | {r['threads']} | "
                         f"{cell(r, 'prefill_tokens_per_s', lambda v: f'{v:,.0f}')} | "
                         f"{cell(r, 'decode_tokens_per_s', lambda v: f'{v:,.1f}')} | {cell(r, 'ttft_s', lambda v: f'{v:.3f}')} | "
                         f"{cell(r, 'peak_rss_bytes', mib)} |")
    lines += ["", "Student / teacher, medians of the same invocation (prefill, decode: > 1 is faster; TTFT, RSS, bytes: < 1 is better):", "",
              "| format | prefill | decode | TTFT | peak RSS | bytes | runs don't overlap (prefill, decode) |",
              "|---|---:|---:|---:|---:|---:|---|"]
    for label, pr in res["pairs"].items():
        q = pr["ratios_b_over_a"]
        sep = [pr["b"]["spread"][m]["min"] > pr["a"]["spread"][m]["max"] for m in ("prefill_tokens_per_s", "decode_tokens_per_s")]
        lines.append(f"| {label} | {q['prefill_tokens_per_s']:.2f} | {q['decode_tokens_per_s']:.2f} | {q['ttft_s']:.2f} | "
                     f"{q['peak_rss_bytes']:.2f} | {q['bytes']:.2f} | {', '.join('yes' if s else 'no' for s in sep)} |")
    lines += ["", "Paired: run i of the student over run i of the teacher, which ran just before it; median (min-max) "
              "over the pairs (load from other jobs that hits both runs of a pair cancels):", "",
              "| format | prefill | decode | TTFT |", "|---|---:|---:|---:|"]
    for label, pr in res["pairs"].items():
        q = pr.get("paired_ratios") or paired(pr)
        lines.append(f"| {label} | " + " | ".join(f"{q[m]['median']:.2f} ({q[m]['min']:.2f}-{q[m]['max']:.2f})" for m in PAIRED) + " |")
    ex = expected(res)
    heads = (res["prune"]["before"]["heads"], res["prune"]["after"]["heads"])
    lines += ["", "What the arithmetic allows (multiply-adds per token, `macs_per_token`): "
              + ("pruning kept the 4 heads x 256 head_dim, so attention over the context costs the same: " if heads[0] == heads[1]
                 else f"query heads {heads[0]} -> {heads[1]} halve attention over the context as well: ")
              + "; ".join(f"{k} (mean context {v['ctx']:,.0f}) teacher {v['teacher_macs'] / 1e6:.1f}M vs student "
                          f"{v['student_macs'] / 1e6:.1f}M = {v['speedup']:.2f}x" for k, v in ex.items())
              + "." + (" Fewer heads (`--heads 2`) cut that part too: see prune_speed_heads2.md." if heads[0] == heads[1] else "")]
    lines += ["", "\"runs don't overlap\": the student's slowest run beat the teacher's fastest run.",
              "A .pte program takes one token per call, so its prefill is that many single-token steps.",
              "Peak RSS of a run = VmHWM of its process: interpreter + runtime + weights + KV cache.", "",
              f"![student / teacher ratios]({png})"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="runtime threads (1: the 2 cores here are shared)")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--prune-extra", default="", help="more hfscale prune flags, e.g. '--heads 2'")
    ap.add_argument("--formats", default=",".join(f[0] for f in FORMATS),
                    help="comma-separated subset of: " + ", ".join(f[0] for f in FORMATS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prune_speed"))
    ap.add_argument("--render", metavar="JSON", help="only rewrite OUT.md and OUT.png from a results JSON (no measuring)")
    a = ap.parse_args(argv)
    if a.render:
        res = json.loads(Path(a.render).read_text())
        plot(res, Path(a.out + ".png"))
        write_text_atomic(a.out + ".md", markdown(res, Path(a.out).name + ".png"))
        return 0
    formats = tuple(f for f in FORMATS if f[0] in a.formats.split(","))
    if not formats:
        ap.error(f"--formats {a.formats!r}: choose from " + ", ".join(f[0] for f in FORMATS))
    from hfscale.export.bench import host_info

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="prune_speed-") as tmp:
        work = Path(tmp)
        pr = build(work, a.layers, a.threads, tuple(a.prune_extra.split()))
        arts = export(work, a.prompt_tokens, a.decode_tokens, formats)
        pairs = {label: bench_pair(ab["teacher"], ab["student"], a.runs, a.prompt_tokens, a.decode_tokens, a.threads)
                 for label, ab in arts.items()}
    res = {"command": "benchmarks/prune_speed.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
           "seconds": time.perf_counter() - t0, "host": host_info(a.threads), "weights": "random (seeded init, untrained)",
           "params": {"teacher": pr["params_before"], "student": pr["params_after"]},
           "prune_summary": f"{pr['params_before']:,} -> {pr['params_after']:,} parameters "
                            f"({pr['params_after'] / pr['params_before']:.3f}x); " + ", ".join(
                                f"{k.replace('_', ' ')} {pr['before'][k]}->{pr['after'][k]}" for k in pr["before"]),
           "prune": pr, "prune_command": f"hfscale prune TEACHER --params 0.5x {a.prune_extra}".strip(),
           "layers": a.layers, "runs": a.runs, "threads": a.threads, "prompt_tokens": a.prompt_tokens,
           "decode_tokens": a.decode_tokens, "pairs": pairs}
    write_text_atomic(a.out + ".json", json.dumps(res, indent=1) + "\n")
    plot(res, Path(a.out + ".png"))
    md = markdown(res, Path(a.out).name + ".png")
    write_text_atomic(a.out + ".md", md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
