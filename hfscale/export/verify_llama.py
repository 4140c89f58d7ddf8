"""Check a GGUF file in llama.cpp itself (llama-cpp-python builds it from source) against the
transformers model it came from: tokenizer agreement, next-token logits / top-1 on the prompt
set, perplexity on the held-out slice; and, where transformers reads the architecture back from
GGUF, the logits of that reload."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from . import evalset as E


@contextmanager
def _plain_cpu_buffers():
    """llama.cpp's `--no-repack` (model param use_extra_bufts=False), which llama-cpp-python 0.3.36 does
    not expose: no repacked AMX / AVX2 weight buffers. Measured on a Xeon with AMX (KVM guest): the AMX
    buffer of a Q4_0 / Q8_0 model segfaults in llama_decode; with plain CPU buffers it runs, F16 too."""
    import llama_cpp.llama_cpp as capi

    default = capi.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    capi.llama_model_default_params = params
    try:
        yield
    finally:
        capi.llama_model_default_params = default


@contextmanager
def open_llama(path: Path, n_ctx: int, lora: Path | None = None):
    """llama.cpp on `path` (plain CPU buffers), with the adapter GGUF `lora` applied at scale 1 if given."""
    import llama_cpp

    kw = {"lora_path": str(lora)} if lora else {}
    with _plain_cpu_buffers():
        llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, verbose=False,
                              n_threads=2, seed=0, **kw)
    try:
        yield llm
    finally:
        llm.close()


def llama_logits(llm, ids):
    import numpy as np

    llm.reset()
    llm.eval(list(ids))
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def check_tokenizer(llm, tokenizer, texts) -> dict:
    """How many texts llama.cpp tokenizes exactly as transformers does, and the first few that differ.

    Both add bos, except to a text that already starts with it (chat-template text does). special=True:
    llama.cpp then matches special tokens in the text, as transformers always does."""
    bos = tokenizer.bos_token
    differ = []
    for t in texts:
        add = not (bos and t.startswith(bos))
        if llm.tokenize(t.encode("utf-8"), add_bos=add, special=True) != tokenizer(t, add_special_tokens=add).input_ids:
            differ.append(t)
    out = {"texts": len(texts), "identical": len(texts) - len(differ)}
    if differ:
        out["differing_texts"] = [t[:120] for t in differ[:3]]
    return out


def verify_gguf(path: Path, model, tokenizer, es: E.EvalSet = E.EvalSet(), progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    prompts = E.prompt_ids(tokenizer, es)
    blocks = E.ppl_blocks(tokenizer, es)
    out: dict = {"runtime": "llama.cpp (llama-cpp-python)"}
    with open_llama(path, n_ctx=max(es.seq_len, es.prompt_tokens)) as llm:
        out["tokenizer"] = check_tokenizer(llm, tokenizer, E.tokenizer_texts(tokenizer, es))
        rows = [E.compare(E.eager_logits(model, p), llama_logits(llm, p))
                for p in tqdm(prompts, desc="llama.cpp logits", disable=not progress)]
        out["vs_transformers"] = E.merge(rows)
        nll_rt = nll_ref = 0.0
        n = 0
        for b in tqdm(blocks.tolist(), desc="llama.cpp perplexity", disable=not progress):
            a, k = E.nll_from_logits(llama_logits(llm, b), b)
            r, _ = E.nll_from_logits(E.eager_logits(model, b), b)
            nll_rt, nll_ref, n = nll_rt + a, nll_ref + r, n + k
    out["perplexity"] = E.ppl(nll_rt, n)
    out["perplexity_transformers_fp32"] = E.ppl(nll_ref, n)
    out["perplexity_tokens"] = n
    out["llama_cpp_version"] = _version()
    return out


# Architectures whose GGUF files transformers cannot read back faithfully, and why: for these the
# reload is reported as not supported instead of producing numbers that measure the reader.
RELOAD_NOT_SUPPORTED = {
    "gemma4_text": "transformers 5.24's gemma4 GGUF reader rejects per-layer hparam arrays (feed_forward_length "
                   "with the double-wide MLP, head_count_kv with k=v attention) and does not map llama.cpp's "
                   "blk.N.layer_output_scale.weight back to layer_scalar (it resets it to 1)",
}


def verify_transformers_reload(path: Path, model, tokenizer, es: E.EvalSet = E.EvalSet()) -> dict:
    """Load the GGUF back with transformers (it dequantizes to fp32) and compare logits.

    transformers 5.24 maps only part of gemma3's GGUF metadata to its config: it ignores the
    per-layer `sliding_window_pattern` (every layer becomes sliding) and leaves
    `query_pre_attn_scalar` at its default 256. So it is measured twice: as transformers reads
    it, and with the source config (the weights alone, as dequantized from the file).
    Architectures in RELOAD_NOT_SUPPORTED are not loaded: {"supported": False, "reason": ...}.
    """
    from transformers import AutoModelForCausalLM

    why = RELOAD_NOT_SUPPORTED.get(getattr(model.config, "model_type", None))
    if why:
        return {"supported": False, "reason": why}
    prompts = E.prompt_ids(tokenizer, es)
    out: dict = {}
    for label, kw in (("as_read", {}), ("source_config", {"config": model.config})):
        try:
            back = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw).eval()
        except Exception as e:  # a second, optional reader: report, do not fail the export
            out[label] = {"loaded": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            continue
        rows = [E.compare(E.eager_logits(model, p), E.eager_logits(back, p)) for p in prompts]
        out[label] = {"loaded": True, **E.merge(rows)}
        if label == "as_read":
            out[label]["config_differences"] = {
                k: [getattr(model.config, k, None), getattr(back.config, k, None)]
                for k in ("layer_types", "query_pre_attn_scalar", "sliding_window", "head_dim")
                if getattr(model.config, k, None) != getattr(back.config, k, None)}
    return out


def _version() -> str:
    import llama_cpp

    return llama_cpp.__version__
