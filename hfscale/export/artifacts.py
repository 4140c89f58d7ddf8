"""The two export entry points behind FORMATS: validate everything first (nothing is written on
bad input), build, verify in the target runtime, then move the artifact into place and write its
sidecar. The artifact is staged beside `out` (hfscale.util.atomic.staged) and renamed only after it
loaded and ran, so `out` never holds a half-written or unverified file."""

from __future__ import annotations

import time
from pathlib import Path

from ..util.atomic import check_writable, staged
from ..util.errors import HfscaleError
from ..util.extras import require
from ..models.builtin import load_for_eval
from . import evalset as E
from .sidecar import sidecar_path, source_info, write_sidecar


def _prepare(model: str, out, force: bool, adapter=None):
    out = Path(out)
    check_writable({out: "--out", sidecar_path(out): "--out"}, force, inputs={model: "MODEL", adapter: "--adapter"})
    if out.exists() and out.is_dir():
        raise HfscaleError(f"{out} is a directory; give a file path for --out")
    from ..models.builtin import load_config

    return out, load_config(model)


def export_gguf(model: str, out, qtype: str = "Q4_0", force: bool = False, embed_qtype: str | None = None,
                verify: bool = True, evalset: E.EvalSet = E.EvalSet(), progress: bool = True,
                reload: bool = True) -> dict:
    """`reload`: also load the file back with transformers' GGUF reader (a second, optional reader, reported in
    the sidecar; llama.cpp's check is the one that decides)."""
    from .gguf import GGUFOptions, check_supported, check_tokenizer, norm_convention, write_gguf

    require("hfscale.export.export_gguf", "edge", ("gguf", "llama_cpp") if verify else ("gguf",))
    opts = GGUFOptions(qtype, embed_qtype)
    out, cfg = _prepare(model, out, force)
    check_supported(cfg)
    m, tok = load_for_eval(model)
    check_tokenizer(tok)
    t0 = time.perf_counter()
    with staged(out) as stage:
        counts = write_gguf(m, tok, stage, opts, name=str(model), progress=progress)
        seconds = time.perf_counter() - t0
        rec = {"format": "gguf", "source": source_info(model, m),
               "scheme": {"qtype": opts.qtype, "token_embedding_qtype": opts.embedding, "tensor_types": counts,
                          "norms": norm_convention(m.config)},
               "export_seconds": seconds}
        if verify:
            from .verify_llama import verify_gguf, verify_transformers_reload

            rec["verification"] = verify_gguf(stage, m, tok, evalset, progress=progress)
            if reload:
                rec["verification"]["transformers_gguf_reload"] = verify_transformers_reload(stage, m, tok, evalset)
    write_sidecar(out, rec)
    return {"out": str(out), "bytes": out.stat().st_size, **rec}


def export_gguf_adapter(model: str, adapter, out, force: bool = False, verify: bool = True,
                        evalset: E.EvalSet = E.EvalSet(n_prompts=4), progress: bool = True) -> dict:
    """A peft LoRA directory `adapter` (trained on `model`) as a llama.cpp adapter GGUF (gguf_adapter), checked
    in llama.cpp on an F16 base GGUF against transformers' merged model."""
    from .gguf import check_supported
    from .gguf_adapter import read_adapter, verify_adapter, write_adapter_gguf

    require("hfscale.export.export_gguf_adapter", "edge", ("gguf", "peft", "llama_cpp") if verify else ("gguf",))
    out, cfg = _prepare(model, out, force, adapter=adapter)
    check_supported(cfg)
    lora = read_adapter(adapter, cfg)
    with staged(out) as stage:
        n = write_adapter_gguf(lora, cfg, stage)
        rec = {"format": "gguf-lora", "source": {"model": str(model), "model_type": cfg.model_type,
                                                 "adapter": str(adapter)},
               "scheme": {"rank": lora.rank, "alpha": lora.alpha, "scale": lora.alpha / lora.rank, "tensors": n,
                          "dtype": "F32", "target_modules": sorted({k.split(".")[-2] for k in lora.pairs})}}
        if verify:
            rec["verification"] = verify_adapter(stage, model, adapter, evalset, progress=progress)
    write_sidecar(out, rec)
    return {"out": str(out), "bytes": out.stat().st_size, **rec}


def export_pte(model: str, out, qtype: str = "8da4w", force: bool = False, max_seq_len: int = 128,
               verify: bool = True, n_generate: int = 16, evalset: E.EvalSet | None = None,
               progress: bool = True) -> dict:
    import copy

    from .pte import check_supported, decode_module, lower_to_pte, quantize_8da4w_, verify_pte

    require("hfscale.export.export_pte", "edge", ("executorch", "torchao"))
    out, cfg = _prepare(model, out, force)
    check_supported(cfg, qtype)
    es = evalset or E.EvalSet(prompt_tokens=min(96, max_seq_len), seq_len=max_seq_len)
    if max(es.prompt_tokens, es.seq_len) > max_seq_len or 16 + n_generate > max_seq_len:
        raise HfscaleError(f"max_seq_len={max_seq_len} is shorter than the verification sequences; raise it")
    fp32, tok = load_for_eval(model)
    same = copy.deepcopy(fp32)
    if qtype == "8da4w":
        quantize_8da4w_(same)
    t0 = time.perf_counter()
    with staged(out) as stage:
        lower_to_pte(decode_module(same, max_seq_len), stage)
        seconds = time.perf_counter() - t0
        rec = {"format": "pte", "source": source_info(model, fp32),
               "scheme": {"qtype": qtype, "backend": "XNNPACK", "max_seq_len": max_seq_len,
                          "method": "forward(input_ids[1,1], cache_position[1]) -> logits, KV cache in-program",
                          "linear": "int8 dynamic activations, int4 weights group 32" if qtype == "8da4w" else "fp32"},
               "export_seconds": seconds}
        if verify:
            rec["verification"] = verify_pte(stage, same, fp32, tok, es, n_generate, progress=progress)
    write_sidecar(out, rec)
    return {"out": str(out), "bytes": out.stat().st_size, **rec}
