"""PTQ and QAT quality on the trained tiny Gemma 3. Writes benchmarks/results/compress.{json,md}.

1. PTQ, every CPU-capable scheme of the registry: weight bytes, held-out perplexity, top-1 agreement
   with the float model (gptq-int4wo with 32 calibration blocks from the *train* split).
2. QAT vs PTQ, for 8da4w and int4 weight-only (group 32 and per-channel), plain and distilled: the same fine-tune (data
   order, steps, lr) run three ways from the same trained start -
       control  no fake quantization                    -> ppl_float(control), ppl_PTQ(control)
       QAT      fake-quantized linears, then convert    -> ppl_QAT
   recovered (vs control) = (ppl_PTQ(control) - ppl_QAT) / (ppl_PTQ(control) - ppl_float(control))
   recovered (vs start)   = (ppl_PTQ(start) - ppl_QAT) / (ppl_PTQ(start) - ppl_float(start))   [torchao's way]
   The control keeps the extra fine-tuning from being counted as QAT's win.
3. QAT's training-speed cost: seconds per step with fake quantization / without, same run.

    .venv/bin/python benchmarks/compress.py [--steps 300] [--base-steps 1200]
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
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hfscale.atomic import write_text_atomic  # noqa: E402
from hfscale.compress.evaluate import EvalData, calibration_blocks, heldout_blocks, recovered, score  # noqa: E402
from hfscale.compress.ptq import ptq_in_memory, quantized_bytes_in_memory  # noqa: E402
from hfscale.compress.qat import convert_qat_, distillation_loss, prepare_qat_  # noqa: E402
from hfscale.compress.schemes import QuantSpec  # noqa: E402
from hfscale.corpus import load_text, packed_blocks  # noqa: E402
from hfscale.models import build_model, load_tokenizer  # noqa: E402
from hfscale.pretrained import TinyTraining, trained_tiny  # noqa: E402

ED = EvalData(n_blocks=64, seq_len=128)  # 64 x 127 = 8,128 scored tokens


def measure(model, blocks, ref_top1=None) -> dict:
    nll, n, top1 = score(model, blocks, ED.batch_size, want_top1=True)
    out = {"perplexity": math.exp(nll / n), "bytes": quantized_bytes_in_memory(model)}
    if ref_top1 is not None:
        out["top1_vs_float"] = float((top1 == ref_top1).float().mean())
    return out, top1


def finetune(model, train, steps: int, lr: float, batch: int, teacher=None, distill: float = 0.0) -> float:
    """Plain AdamW loop, fixed data order (seed 1), linear warm-up 10 steps then constant. Returns s/step."""
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    t0 = time.perf_counter()
    for s in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (s + 1) / 10)
        b = train[order[(torch.arange(batch) + s * batch) % len(train)]]
        if teacher is None:
            loss = model(input_ids=b, labels=b).loss
        else:
            with torch.no_grad():
                t = teacher(input_ids=b).logits
            loss = distillation_loss(model(input_ids=b).logits, t, b, distill)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    return (time.perf_counter() - t0) / steps


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


def qat_rows(base: str, blocks, train, steps: int, lr: float, batch: int, work: Path) -> tuple[list[dict], dict]:
    """QAT runs, each against the control with the *same* loss (plain CE, or CE + KL to the start model)."""
    from hfscale.compress.save import save_model_dir

    start = build_model(base, dtype=torch.float32).eval()
    ppl_start = measure(start, blocks)[0]["perplexity"]
    controls = {}
    for distill in tqdm((0.0, 0.5), desc="control runs"):
        control = copy.deepcopy(start)
        s = finetune(control, train, steps, lr, batch, teacher=start if distill else None, distill=distill)
        save_model_dir(control, work / f"control-{distill}", tokenizer=load_tokenizer(base), force=True)
        controls[distill] = {"dir": str(work / f"control-{distill}"), "s_per_step": s,
                             "ppl_float": measure(control, blocks)[0]["perplexity"]}
    rows = []
    variants = [("8da4w", 32, 0.0), ("8da4w", 32, 0.5), ("int4wo", 32, 0.0), ("int4wo", 0, 0.0), ("int4wo", 0, 0.5),
                ("int3wo", 32, 0.0), ("int2wo", 32, 0.0)]  # 3 and 2 bits: where PTQ's loss is large enough to measure
    for scheme, gs, distill in tqdm(variants, desc="QAT runs"):
        spec, ctl = QuantSpec(scheme, group_size=gs), controls[distill]
        ppl_ptq_start = measure(ptq_in_memory(base, spec), blocks)[0]["perplexity"]
        ppl_ptq_control = measure(ptq_in_memory(ctl["dir"], spec), blocks)[0]["perplexity"]
        model = prepare_qat_(copy.deepcopy(start), spec)
        s_qat = finetune(model, train, steps, lr, batch, teacher=start if distill else None, distill=distill)
        ppl_qat = measure(convert_qat_(model, spec), blocks)[0]["perplexity"]
        rows.append({"scheme": scheme, "group_size": gs, "distill": distill, "steps": steps,
                     "ppl_float_start": ppl_start, "ppl_ptq_start": ppl_ptq_start,
                     "ppl_float_control": ctl["ppl_float"], "ppl_ptq_control": ppl_ptq_control, "ppl_qat": ppl_qat,
                     "recovered_vs_control": recovered(ctl["ppl_float"], ppl_ptq_control, ppl_qat),
                     "recovered_vs_start": recovered(ppl_start, ppl_ptq_start, ppl_qat),
                     "s_per_step_qat": s_qat, "s_per_step_control": ctl["s_per_step"],
                     "qat_step_time_ratio": s_qat / ctl["s_per_step"]})
    return rows, {str(k): {kk: vv for kk, vv in v.items() if kk != "dir"} for k, v in controls.items()}


def pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def markdown(res: dict) -> str:
    lines = ["# Compression quality: PTQ and QAT on the trained tiny Gemma 3", "",
             f"Generated by `benchmarks/compress.py`. Base: {res['base']} ({res['base_training']}). Held-out perplexity over "
             f"{res['eval_tokens']:,} tokens of the built-in corpus's validation split (never trained on).", "",
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
    lines += ["", f"## QAT vs PTQ ({res['qat'][0]['steps']} fine-tuning steps, lr {res['lr']}, batch {res['batch']} x 128)", "",
              "| scheme | group | distill | float start | PTQ start | float control | PTQ control | QAT | recovered vs control | "
              "recovered vs start | QAT s/step / control |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["qat"]:
        lines.append(f"| {r['scheme']} | {r['group_size'] or 'channel'} | {r['distill']} | {r['ppl_float_start']:.3f} | "
                     f"{r['ppl_ptq_start']:.3f} | {r['ppl_float_control']:.3f} | {r['ppl_ptq_control']:.3f} | {r['ppl_qat']:.3f} | "
                     f"{pct(r['recovered_vs_control'])} | {pct(r['recovered_vs_start'])} | {r['qat_step_time_ratio']:.2f} |")
    lines += ["", "recovered vs control = (PTQ(control) - QAT) / (PTQ(control) - float(control)): the control is the same "
              "fine-tune (same data order, steps, lr and loss - distill 0.5 = half CE, half KL to the start model) without "
              "fake quantization, so extra training is not counted as QAT's win. recovered vs start is torchao's convention "
              "and includes the fine-tune's own gain. s/step ratio: QAT over its control, same process.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--base-steps", type=int, default=1200, help="pre-training steps of the tiny base (cached)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compress"))
    a = p.parse_args(argv)
    torch.manual_seed(0)
    recipe = TinyTraining(steps=a.base_steps, warmup=40) if a.base_steps != TinyTraining().steps else TinyTraining()
    base = str(trained_tiny(recipe))
    tok = load_tokenizer(base)
    blocks = heldout_blocks(tok, ED)
    train = packed_blocks(tok, load_text()["train"]["text"], 128)
    fl, ref_top1 = measure(build_model(base, dtype=torch.float32).eval(), blocks)
    res = {"base": Path(base).name, "base_training": json.loads((Path(base) / "hfscale_training.json").read_text())["recipe"],
           "eval_tokens": int(blocks[:, 1:].numel()), "float": fl, "lr": a.lr, "batch": a.batch}
    res["ptq"] = ptq_rows(base, blocks, ref_top1, tok)
    with tempfile.TemporaryDirectory() as tmp:
        res["qat"], res["control"] = qat_rows(base, blocks, train, a.steps, a.lr, a.batch, Path(tmp))
    write_text_atomic(a.out + ".json", json.dumps(res, indent=1) + "\n")
    write_text_atomic(a.out + ".md", markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
