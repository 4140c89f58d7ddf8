"""PTQ and QAT quality on the trained tiny Gemma 3. Writes benchmarks/results/compress.{json,md}.

1. PTQ, every CPU-capable scheme of the registry: weight bytes, held-out perplexity, top-1 agreement
   with the float model (gptq-int4wo with 32 calibration blocks from the *train* split).
2. QAT vs PTQ, for 8da4w and int4 weight-only (group 32; per-channel, 3 and 2 bits as stress rows; a distilled pair):
   the same fine-tune (benchmarks/finetune.py: data order, steps, lr schedule, loss) from the same trained start -
       control  no fake quantization                    -> ppl_float(control), ppl_PTQ(control)
       QAT      fake-quantized linears, then convert    -> ppl_QAT
   recovered (vs control) = (ppl_PTQ(control) - ppl_QAT) / (ppl_PTQ(control) - ppl_float(control))
   recovered (vs start)   = (ppl_PTQ(start) - ppl_QAT) / (ppl_PTQ(start) - ppl_float(start))   [torchao's way]
   The control keeps the extra fine-tuning from being counted as QAT's win. The headline schemes are
   repeated over --seeds data orders; arms run --jobs at a time, one process each.
3. QAT's training-speed cost: seconds per step with fake quantization / without, alternated in one process.

    .venv/bin/python benchmarks/compress.py [--steps 1200] [--seeds 2] [--jobs 2]   # ~40 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hfscale.util.atomic import write_text_atomic  # noqa: E402
from hfscale.compress.evaluate import EvalData, calibration_blocks, heldout_blocks, recovered, score  # noqa: E402
from hfscale.compress.ptq import ptq_in_memory, quantized_bytes_in_memory  # noqa: E402
from hfscale.compress.qat import convert_qat_, prepare_qat_  # noqa: E402
from hfscale.compress.schemes import QuantSpec  # noqa: E402
from hfscale.data.corpus import load_text, packed_blocks  # noqa: E402
from hfscale.models import build_model, load_tokenizer  # noqa: E402
from hfscale.testing.trained import TinyTraining, trained_tiny  # noqa: E402

from finetune import FineTune, finetune  # noqa: E402  (benchmarks/finetune.py)

ED = EvalData(n_blocks=210, seq_len=128)  # the whole validation split of the built-in corpus: 210 x 127 = 26,670 tokens


def measure(model, blocks, ref_top1=None) -> dict:
    nll, n, top1 = score(model, blocks, ED.batch_size, want_top1=True)
    out = {"perplexity": math.exp(nll / n), "bytes": quantized_bytes_in_memory(model)}
    if ref_top1 is not None:
        out["top1_vs_float"] = float((top1 == ref_top1).float().mean())
    return out, top1


def ptq_rows(base: str, blocks, ref_top1, tok) -> list[dict]:
    rows = []
    calib = calibration_blocks(tok, 32, 128)
    specs = [QuantSpec("int8wo"), QuantSpec("int8dq"), QuantSpec("8da4w"), QuantSpec("8da4w", group_size=0),
             QuantSpec("int4wo"), QuantSpec("int4wo", group_size=0), QuantSpec("int3wo"), QuantSpec("int2wo"), QuantSpec("gptq-int4wo"),
             QuantSpec("gptq-int4wo", group_size=0), QuantSpec("nf4"), QuantSpec("fp4"), QuantSpec("llm.int8")]
    for spec in tqdm(specs, desc="PTQ schemes"):
        try:
            m = ptq_in_memory(base, spec, calibration=calib if spec.info.calibrated else None)
        except ImportError as e:  # gptq lands separately
            rows.append({"scheme": spec.scheme, "group_size": spec.group_size, "error": str(e)})
            continue
        r, _ = measure(m, blocks, ref_top1)
        rows.append({"scheme": spec.scheme, "group_size": spec.group_size, **r})
    return rows


QAT_SCHEMES = {"8da4w": 32, "int4wo": 32, "int4wo/channel": 0, "int3wo": 32, "int2wo": 32}


def spec_of(name: str) -> QuantSpec:
    return QuantSpec(name.split("/")[0], group_size=QAT_SCHEMES[name])


def run_arm(base: str, arm: dict, threads: int) -> dict:
    """One fine-tune from the trained start, in its own process. arm: {"scheme": None (control) or a
    QAT_SCHEMES key, "ft": FineTune fields, "ptq": schemes to PTQ (control only)}. Returns perplexities."""
    torch.set_num_threads(threads)
    from hfscale.compress.save import save_model_dir

    ft = FineTune(**arm["ft"])
    tok = load_tokenizer(base)
    blocks = heldout_blocks(tok, ED)
    train = packed_blocks(tok, load_text()["train"]["text"], ED.seq_len)
    model = build_model(base, dtype=torch.float32)
    teacher = build_model(base, dtype=torch.float32).eval().requires_grad_(False) if ft.distill else None
    out = dict(arm)
    if arm["scheme"] is None:
        out["s_per_step"] = finetune(model, train, ft, teacher)
        out["ppl_float"] = measure(model, blocks)[0]["perplexity"]
        with tempfile.TemporaryDirectory() as tmp:
            save_model_dir(model, Path(tmp) / "control", tokenizer=tok, force=True)
            out["ppl_ptq"] = {name: measure(ptq_in_memory(str(Path(tmp) / "control"), spec_of(name)), blocks)[0]["perplexity"]
                              for name in arm["ptq"]}
    else:
        spec = spec_of(arm["scheme"])
        out["s_per_step"] = finetune(prepare_qat_(model, spec), train, ft, teacher)
        out["ppl_qat"] = measure(convert_qat_(model, spec), blocks)[0]["perplexity"]
    return out


def qat_rows(base: str, ft: FineTune, seeds: tuple[int, ...], jobs: int) -> tuple[list[dict], list[dict]]:
    """Every QAT arm against the control with the same seed (data order) and loss, arms run `jobs` at a time.

    Seed 1 runs every scheme and a distilled pair; further seeds repeat the two headline schemes, so
    the spread across data orders is on the table next to the mean."""
    arms = []
    for seed in seeds:
        names = list(QAT_SCHEMES) if seed == seeds[0] else ["8da4w", "int4wo"]
        f = asdict(replace(ft, seed=seed))
        arms += [{"scheme": None, "ft": f, "ptq": names}] + [{"scheme": n, "ft": f} for n in names]
    fd = asdict(replace(ft, seed=seeds[0], distill=0.5))
    arms += [{"scheme": None, "ft": fd, "ptq": ["int4wo"]}, {"scheme": "int4wo", "ft": fd}]
    threads = max(1, (os.cpu_count() or 1) // jobs)
    done = []
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futs = [pool.submit(run_arm, base, arm, threads) for arm in arms]
        for fut in tqdm(as_completed(futs), total=len(futs), desc=f"fine-tune arms ({jobs} at a time)"):
            done.append(fut.result())
    key = lambda a: (a["ft"]["seed"], a["ft"]["distill"])  # noqa: E731
    controls = {key(a): a for a in done if a["scheme"] is None}
    rows = []
    for a in sorted((a for a in done if a["scheme"]), key=lambda a: (list(QAT_SCHEMES).index(a["scheme"]), key(a))):
        c = controls[key(a)]
        rows.append({"scheme": a["scheme"], "seed": a["ft"]["seed"], "distill": a["ft"]["distill"],
                     "steps": ft.steps, "ppl_float_control": c["ppl_float"], "ppl_ptq_control": c["ppl_ptq"][a["scheme"]],
                     "ppl_qat": a["ppl_qat"],
                     "recovered_vs_control": recovered(c["ppl_float"], c["ppl_ptq"][a["scheme"]], a["ppl_qat"])})
    return rows, sorted(controls.values(), key=key)


def qat_cost(base: str, train, ft: FineTune, chunk: int = 20, rounds: int = 3) -> dict:
    """QAT's training-speed cost: s/step with fake quantization over s/step without, one process, chunks
    alternated so both see the same machine load. Median of the per-round ratios."""
    out = {}
    for name in ("8da4w", "int4wo"):
        plain, qat = build_model(base, dtype=torch.float32), prepare_qat_(build_model(base, dtype=torch.float32), spec_of(name))
        short = replace(ft, steps=chunk)
        ratios = []
        for r in range(rounds):
            t_plain = finetune(plain, train, replace(short, seed=r))
            t_qat = finetune(qat, train, replace(short, seed=r))
            ratios.append(t_qat / t_plain)
        out[name] = {"ratios": ratios, "median": statistics.median(ratios)}
    return out


def pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def start_ptq(res: dict, name: str) -> float:
    spec = spec_of(name)
    return next(r["perplexity"] for r in res["ptq"] if r["scheme"] == spec.scheme and r["group_size"] == spec.group_size)


def markdown(res: dict) -> str:
    lines = ["# Compression quality: PTQ and QAT on the trained tiny Gemma 3", "",
             f"Generated by `benchmarks/compress.py`. Base: {res['base']} ({res['base_training']}). Held-out perplexity over "
             f"{res['eval_tokens']:,} tokens: the whole validation split of the built-in corpus (never trained on).", "",
             "## PTQ", "", "| scheme | group | weight bytes in memory | vs float | perplexity | top-1 vs float |",
             "|---|---:|---:|---:|---:|---:|",
             f"| float32 | - | {res['float']['bytes']:,} | 1.000 | {res['float']['perplexity']:.3f} | 1.000 |"]
    for r in res["ptq"]:
        if "error" in r:
            lines.append(f"| {r['scheme']} | {r['group_size']} | - | - | not run: {r['error'][:60]} | - |")
            continue
        group = "-" if r["scheme"] in ("nf4", "fp4", "llm.int8") else (r["group_size"] or "channel")
        lines.append(f"| {r['scheme']} | {group} | {r['bytes']:,} | {r['bytes'] / res['float']['bytes']:.3f} | "
                     f"{r['perplexity']:.3f} | {r['top1_vs_float']:.3f} |")
    ft = res["finetune"]
    lines += ["", f"## QAT vs PTQ ({ft['steps']} fine-tuning steps, batch {ft['batch']} x {ED.seq_len}, AdamW lr {ft['lr']}, "
              f"warm-up {ft['warmup']} then cosine to 0)", "",
              "| scheme | group | seed | distill | float control | PTQ control | QAT | recovered vs control | "
              "recovered vs start (torchao's way) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["qat"]:
        ptq0 = start_ptq(res, r["scheme"])
        lines.append(f"| {r['scheme'].split('/')[0]} | {spec_of(r['scheme']).group_size or 'channel'} | {r['seed']} | {r['distill']} | "
                     f"{r['ppl_float_control']:.3f} | {r['ppl_ptq_control']:.3f} | {r['ppl_qat']:.3f} | "
                     f"**{pct(r['recovered_vs_control'])}** | {pct(recovered(res['float']['perplexity'], ptq0, r['ppl_qat']))} |")
    lines += ["", "Mean over data orders (plain CE):", "", "| scheme | group | seeds | recovered vs control, each | mean |",
              "|---|---:|---:|---|---:|"]
    for name, m in res["qat_mean"].items():
        lines.append(f"| {name.split('/')[0]} | {spec_of(name).group_size or 'channel'} | {len(m['each'])} | "
                     f"{', '.join(pct(x) for x in m['each'])} | **{pct(m['mean'])}** |")
    lines += ["", "recovered vs control = (PTQ(control) - QAT) / (PTQ(control) - float(control)). The control is the same "
              "fine-tune from the same start (same data order, steps, lr schedule and loss; distill 0.5 = half CE, half KL "
              "to the start model) without fake quantization, so the fine-tune's own gain is not counted as QAT's. "
              "recovered vs start = (PTQ(start) - QAT) / (PTQ(start) - float(start)) is torchao's convention and includes "
              "that gain.", "", "## QAT training-speed cost", "",
              f"Seconds per step with fake quantization over without, {res['cost']['chunk']}-step chunks alternated in one "
              "process (median of rounds):", "", "| scheme | ratio per round | median |", "|---|---|---:|"]
    for name, c in res["cost"]["schemes"].items():
        lines.append(f"| {name} | {', '.join(f'{x:.2f}' for x in c['ratios'])} | {c['median']:.2f}x |")
    return "\n".join(lines + [""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = FineTune()
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--seeds", type=int, default=2, help="data orders for the headline schemes (8da4w, int4wo g32)")
    p.add_argument("--jobs", type=int, default=2, help="fine-tune arms run at a time (one process each)")
    p.add_argument("--base-steps", type=int, default=1200, help="pre-training steps of the tiny base (cached)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compress"))
    a = p.parse_args(argv)
    torch.manual_seed(0)
    recipe = TinyTraining(steps=a.base_steps, warmup=40) if a.base_steps != TinyTraining().steps else TinyTraining()
    base = str(trained_tiny(recipe))
    tok = load_tokenizer(base)
    blocks = heldout_blocks(tok, ED)
    train = packed_blocks(tok, load_text()["train"]["text"], ED.seq_len)
    ft = FineTune(steps=a.steps, lr=a.lr, batch=a.batch)
    fl, ref_top1 = measure(build_model(base, dtype=torch.float32).eval(), blocks)
    res = {"base": Path(base).name, "base_training": json.loads((Path(base) / "hfscale_training.json").read_text())["recipe"],
           "eval_tokens": int(blocks[:, 1:].numel()), "float": fl, "finetune": asdict(ft)}
    res["ptq"] = ptq_rows(base, blocks, ref_top1, tok)
    res["cost"] = {"chunk": 20, "schemes": qat_cost(base, train, ft, chunk=20)}
    res["qat"], res["controls"] = qat_rows(base, ft, tuple(range(1, a.seeds + 1)), a.jobs)
    res["qat_mean"] = {}
    for name in QAT_SCHEMES:
        each = [r["recovered_vs_control"] for r in res["qat"] if r["scheme"] == name and r["distill"] == 0]
        res["qat_mean"][name] = {"each": each, "mean": statistics.fmean(each)}
    write_text_atomic(a.out + ".json", json.dumps(res, indent=1) + "\n")
    write_text_atomic(a.out + ".md", markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
