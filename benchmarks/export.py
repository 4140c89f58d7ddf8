"""Edge export, measured in the target runtimes. Writes benchmarks/results/export.{json,md}.

1. The trained tiny Gemma 3 (hfscale.testing.trained.trained_tiny, 1200 steps by default): every GGUF qtype in llama.cpp and
   every .pte qtype in executorch.runtime: file size, top-1 agreement and max |dlogit| vs
   transformers fp32 on the held-out prompt set, perplexity on the held-out slice.
2. A larger config built from dimensions (random init, 8 layers, hidden 512): GGUF sizes, export
   time, agreement (random weights: agreement only, perplexity is meaningless there).
3. llama.cpp's own converter (convert_hf_to_gguf.py from the llama-cpp-python sdist, path in
   $LLAMA_CPP_SRC, default /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp) on the same models.
4. QAT vs PTQ at Q4_0, measured after export in llama.cpp: a short Q4_0 QAT fine-tune with
   hfscale.compress.ggml_grid, and the same fine-tune without fake-quant as the control, so that
   "recovered" is not credit for extra training:
       recovered = (ppl PTQ(control) - ppl QAT) / (ppl PTQ(control) - ppl fp32(control)).

    .venv/bin/python benchmarks/export.py [--qat-steps 1200]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hfscale.util.atomic import write_text_atomic  # noqa: E402
from hfscale.compress.ggml_grid import convert_q4_0_, prepare_q4_0_qat_  # noqa: E402
from hfscale.data.corpus import load_text, packed_blocks  # noqa: E402
from hfscale.export import FORMATS  # noqa: E402
from hfscale.export.evalset import EvalSet  # noqa: E402
from hfscale.models import build_model, load_tokenizer  # noqa: E402
from hfscale.testing.trained import TinyTraining, trained_tiny  # noqa: E402

from finetune import FineTune, finetune  # noqa: E402  (benchmarks/finetune.py)

ES = EvalSet(n_prompts=8, prompt_tokens=96, ppl_blocks=32, seq_len=128)  # 4,064 scored tokens
# QAT vs PTQ: margins of a few hundredths of perplexity, so the whole validation split (26,670 tokens)
ES_QAT = EvalSet(n_prompts=8, prompt_tokens=96, ppl_blocks=210, seq_len=128)
LLAMA_SRC = Path(os.environ.get("LLAMA_CPP_SRC", "/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp"))


def row(r: dict) -> dict:
    v = r.get("verification", {})
    cmp = v.get("vs_transformers") or v.get("vs_transformers_fp32") or {}
    out = {"format": r["format"], "qtype": r["scheme"]["qtype"], "bytes": r["bytes"],
           "fp32_bytes": r["source"]["fp32_bytes"], "export_seconds": round(r["export_seconds"], 2),
           "top1_agreement": cmp.get("top1_agreement"), "max_abs_dlogit": cmp.get("max_abs_dlogit"),
           "perplexity": v.get("perplexity"), "perplexity_fp32": v.get("perplexity_transformers_fp32")}
    if r["format"] == "gguf":
        out["token_embedding"] = r["scheme"]["token_embedding_qtype"]
        out["tokenizer_identical"] = v.get("tokenizer")
        out["transformers_reload"] = v.get("transformers_gguf_reload")
    else:
        out["greedy_identical"] = v.get("greedy", {}).get("identical")
        out["vs_eager_same_quantization"] = v.get("vs_eager_same_quantization")
        out["median_ms_per_token"] = 1000 * v["median_seconds_per_token"] if v else None
    return out


def tiny_rows(model: str, work: Path) -> list[dict]:
    jobs = [("gguf", q, None) for q in ("F16", "BF16", "Q8_0", "Q4_0")] + [("gguf", "Q4_0", "Q4_0"), ("gguf", "Q4_0", "F16")]
    jobs += [("pte", "fp32", None), ("pte", "8da4w", None)]
    rows = []
    for fmt, q, emb in tqdm(jobs, desc="tiny exports"):
        kw = {"embed_qtype": emb} if emb else {}
        r = FORMATS[fmt].export(model, work / f"tiny-{q}-{emb}.{fmt}", q, True, evalset=ES, progress=False, **kw)
        rows.append(row(r))
    return rows


def larger_model(work: Path) -> str:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=64, query_pre_attn_scalar=64,
                           max_position_embeddings=2048, sliding_window=128,
                           layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2,
                           pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
                           attn_implementation="eager")
    torch.manual_seed(0)
    d = work / "gemma3-8x512"
    Gemma3ForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    load_tokenizer("tiny-gemma3").save_pretrained(d)
    return str(d)


def larger_rows(model: str, work: Path) -> list[dict]:
    es = EvalSet(n_prompts=4, prompt_tokens=96, ppl_blocks=2, seq_len=128)
    rows = []
    for q in tqdm(("F16", "Q8_0", "Q4_0"), desc="8x512 exports"):
        rows.append(row(FORMATS["gguf"].export(model, work / f"big-{q}.gguf", q, True, evalset=es, progress=False)))
    rows.append(row(FORMATS["pte"].export(model, work / "big-fp32.pte", "fp32", True, evalset=es, progress=False)))
    return rows


def llama_converter(model: str, work: Path) -> dict:
    script = LLAMA_SRC / "convert_hf_to_gguf.py"
    if not script.is_file():
        return {"available": False, "note": f"{script} not found (pip download llama-cpp-python --no-binary :all:)"}
    out = work / "llama-convert-f16.gguf"
    env = {**os.environ, "PYTHONPATH": str(LLAMA_SRC / "gguf-py"), "HF_HUB_OFFLINE": "1"}
    t = time.perf_counter()
    p = subprocess.run([sys.executable, str(script), model, "--outtype", "f16", "--outfile", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    seconds = time.perf_counter() - t
    errs = [ln for ln in (p.stderr + p.stdout).splitlines() if "Error" in ln or "error" in ln]
    return {"available": True, "returncode": p.returncode, "seconds": round(seconds, 2),
            "bytes": out.stat().st_size if out.exists() else None, "last_error": errs[-1][:300] if errs else None}


def finetuned(model_dir: str, ft: FineTune, qat: bool, out: Path) -> str:
    """The trained tiny model after benchmarks/finetune.py's fine-tune, with or without Q4_0 fake quantization."""
    tok = load_tokenizer(model_dir)
    m = build_model(model_dir, dtype=torch.float32)
    if qat:
        prepare_q4_0_qat_(m)
    finetune(m, packed_blocks(tok, load_text()["train"]["text"], 128), ft, desc=f"{'QAT' if qat else 'control'} fine-tune")
    if qat:
        convert_q4_0_(m)
    m.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return str(out)


def qat_vs_ptq(model: str, work: Path, ft: FineTune) -> dict:
    control = finetuned(model, ft, False, work / "ft-control")
    qat = finetuned(model, ft, True, work / "ft-qat")
    res = {"steps": ft.steps, "lr": ft.lr, "batch_tokens": ft.batch * 128, "finetune": asdict(ft)}
    for label, src in (("control", control), ("qat", qat), ("start", model)):
        r = FORMATS["gguf"].export(src, work / f"{label}-Q4_0.gguf", "Q4_0", True, evalset=ES_QAT, progress=False)
        v = r["verification"]
        res[label] = {"ppl_fp32_transformers": v["perplexity_transformers_fp32"], "ppl_q4_0_llama_cpp": v["perplexity"],
                      "top1_vs_own_fp32": v["vs_transformers"]["top1_agreement"]}
    fp, ptq, q = res["control"]["ppl_fp32_transformers"], res["control"]["ppl_q4_0_llama_cpp"], res["qat"]["ppl_q4_0_llama_cpp"]
    res["ptq_loss_ppl"] = ptq - fp
    res["recovered_pct"] = 100 * (ptq - q) / (ptq - fp) if abs(ptq - fp) > 1e-9 else None
    res["eval_tokens"] = ES_QAT.ppl_blocks * (ES_QAT.seq_len - 1)
    res["qat_export_exact"] = res["qat"]["top1_vs_own_fp32"]  # converted weights are on the grid: llama.cpp == fp32
    return res


def markdown(res: dict) -> str:
    def table(rows):
        lines = ["| format | qtype | embedding | bytes | vs fp32 | export s | top-1 | max abs dlogit | ppl runtime | ppl fp32 | note |",
                 "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            note = (f"greedy=eager {r['greedy_identical']}, {r['median_ms_per_token']:.2f} ms/token"
                    if r["format"] == "pte" else f"tokenizer {r['tokenizer_identical']['identical']}/{r['tokenizer_identical']['texts']}")
            ppl = f"{r['perplexity']:.2f}" if r["perplexity"] else "-"
            lines.append(f"| {r['format']} | {r['qtype']} | {r.get('token_embedding', '-')} | {r['bytes']:,} | "
                         f"{r['bytes'] / r['fp32_bytes']:.3f} | {r['export_seconds']} | {r['top1_agreement']:.3f} | "
                         f"{r['max_abs_dlogit']:.4f} | {ppl} | {r['perplexity_fp32']:.2f} | {note} |")
        return "\n".join(lines)

    q = res["qat_vs_ptq"]
    rec = "n/a" if q["recovered_pct"] is None else f"{q['recovered_pct']:.1f}%"
    return "\n".join([
        "# Edge export, measured in llama.cpp and executorch.runtime", "",
        f"Generated by `benchmarks/export.py`; held-out prompts {ES.n_prompts}x{ES.prompt_tokens} tokens, "
        f"perplexity over {ES.ppl_blocks} blocks of {ES.seq_len}. top-1 / max|dlogit| vs transformers fp32.", "",
        f"## Trained tiny Gemma 3 ({res['base']}: {res['base_training']})", "", table(res["tiny"]), "",
        "## 8 layers x hidden 512, random init (agreement and size only)", "", table(res["larger"]), "",
        "## llama.cpp's convert_hf_to_gguf.py on the same models", "",
        "```", json.dumps(res["llama_converter"], indent=1), "```", "",
        f"## QAT vs PTQ at Q4_0, perplexity in llama.cpp ({q['steps']} steps, batch {q['batch_tokens']:,} tokens, lr {q['lr']} "
        f"cosine to 0; {q.get('eval_tokens', 0):,} held-out tokens)", "",
        "| model | ppl fp32 (transformers) | ppl Q4_0 (llama.cpp) |", "|---|---:|---:|",
        *[f"| {k} | {q[k]['ppl_fp32_transformers']:.3f} | {q[k]['ppl_q4_0_llama_cpp']:.3f} |" for k in ("start", "control", "qat")],
        "", f"PTQ perplexity loss (control): {q['ptq_loss_ppl']:.3f}; recovered by QAT after export: **{rec}**.", ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qat-steps", type=int, default=FineTune().steps)
    ap.add_argument("--qat-lr", type=float, default=FineTune().lr)
    ap.add_argument("--base-steps", type=int, default=1200, help="pre-training steps of the tiny base (cached)")
    a = ap.parse_args(argv)
    model = str(trained_tiny(TinyTraining(steps=a.base_steps, warmup=40) if a.base_steps != TinyTraining().steps else TinyTraining()))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        big = larger_model(work)
        res = {"torch": torch.__version__, "base": Path(model).name,
               "base_training": json.loads((Path(model) / "hfscale_training.json").read_text())["recipe"],
               "tiny": tiny_rows(model, work), "larger": larger_rows(big, work),
               "llama_converter": {"tiny": llama_converter(model, work), "8x512": llama_converter(big, work)},
               "qat_vs_ptq": qat_vs_ptq(model, work, FineTune(steps=a.qat_steps, lr=a.qat_lr))}
    res["tiny_fp32_bytes"] = res["tiny"][0]["fp32_bytes"]
    out = ROOT / "benchmarks" / "results"
    write_text_atomic(out / "export.json", json.dumps(res, indent=2) + "\n")
    write_text_atomic(out / "export.md", markdown(res))
    print(markdown(res))
    return 0 if all(math.isfinite(r["max_abs_dlogit"]) for r in res["tiny"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
