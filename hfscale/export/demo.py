"""`make demo`'s export step: one model directory -> GGUF Q4_0 and .pte 8da4w, each run in its
runtime, one table back. Small verification slices keep it to about a minute or two."""

from __future__ import annotations

from pathlib import Path

from .artifacts import export_gguf, export_pte
from .evalset import EvalSet

DEMO_EVAL = EvalSet(n_prompts=4, prompt_tokens=96, ppl_blocks=4, seq_len=128)


def rows_table(rows: list[dict]) -> str:
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


def demo_step(model_dir, out_dir) -> str:
    out = Path(out_dir)
    g = export_gguf(str(model_dir), out / "model-Q4_0.gguf", "Q4_0", force=True, evalset=DEMO_EVAL)
    p = export_pte(str(model_dir), out / "model-8da4w.pte", "8da4w", force=True, n_generate=16, evalset=DEMO_EVAL)
    return rows_table([g, p])
