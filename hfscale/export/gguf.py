"""Write a Gemma 3 text model as GGUF for llama.cpp, with the `gguf` package's GGUFWriter.

What llama.cpp's gemma3 loader reads (src/models/gemma3.cpp in the vendored llama.cpp):
- hparams: context/embedding/block/ffn lengths, head counts, key/value length (head_dim),
  rms eps, rope base for global layers (`rope.freq_base`) and local ones (`rope.freq_base_swa`),
  `attention.sliding_window` and the per-layer `sliding_window_pattern` as a bool array (without
  it llama.cpp assumes Gemma's 5:1 pattern, wrong for our 3:1 tiny model).
- attention scale: llama.cpp hard-codes 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 62-layer
  27B), so a config whose `query_pre_attn_scalar` differs is refused rather than exported wrong.
- norms: Gemma's RMSNorm computes x·(1 + w); llama.cpp multiplies by the stored weight, so we
  store 1 + w (in F32, they are tiny).
- tied embeddings: no `output.weight`; llama.cpp reuses `token_embd` as the output head, so the
  token embedding's type is also the output projection's type (hence its own option).
- tokenizer: ours is a BPE over "▁"-escaped text with byte fallback (SentencePiece-style, not
  GPT-2 byte-level), so it is stored as llama.cpp's "llama" (SPM) model: merged tokens get score
  -rank of the merge that creates them, bytes are BYTE tokens, specials CONTROL, no space prefix.
  `verify_llama.check_tokenizer` proves the two tokenizers agree on the texts used.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import HfscaleError

QTYPES = ("F16", "BF16", "Q8_0", "Q4_0")
EMBED_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
SUPPORTED_MODEL_TYPES = ("gemma3_text",)


def default_embed_qtype(qtype: str) -> str:
    """Float exports keep the embedding at their own precision; quantized ones keep it at Q8_0.

    For Gemma the token embedding is also the (tied) output head over a 262k vocabulary: llama.cpp
    measured Gemma perplexity 9.48 with Q8_0 embeddings vs 9.68 with Q6_K (ANCHORS), and it is a
    small share of the file for the real models' ratios of vocab to depth.
    """
    return qtype if qtype in ("F16", "BF16") else "Q8_0"


@dataclass(frozen=True)
class GGUFOptions:
    qtype: str = "Q4_0"
    embed_qtype: str | None = None  # None: default_embed_qtype(qtype)

    def __post_init__(self):
        if self.qtype not in QTYPES:
            raise HfscaleError(f"GGUF qtype {self.qtype!r} is not supported; choose one of {', '.join(QTYPES)}")
        if self.embed_qtype is not None and self.embed_qtype not in EMBED_QTYPES:
            raise HfscaleError(f"GGUF embedding qtype {self.embed_qtype!r} is not supported; "
                               f"choose one of {', '.join(EMBED_QTYPES)}")

    @property
    def embedding(self) -> str:
        return self.embed_qtype or default_embed_qtype(self.qtype)


def check_supported(config) -> None:
    """Refuse, in one line, configs llama.cpp's gemma3 graph would run wrongly."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        why = " (Gemma 4 GGUF export is not implemented yet)" if mt and mt.startswith("gemma4") else ""
        raise HfscaleError(f"GGUF export supports model types {', '.join(SUPPORTED_MODEL_TYPES)} "
                           f"(Gemma 3 text and the built-in tiny-gemma3), not {mt!r}{why}")
    scale = config.hidden_size // config.num_attention_heads if config.num_hidden_layers == 62 else config.head_dim
    if config.query_pre_attn_scalar != scale:
        raise HfscaleError(f"query_pre_attn_scalar={config.query_pre_attn_scalar} but llama.cpp's gemma3 uses "
                           f"{scale} for this shape; this model cannot be exported to GGUF faithfully")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise HfscaleError("attn_logit_softcapping is set but llama.cpp's gemma3 has none; cannot export")
    for kind, rp in _rope(config).items():
        rtype = rp.get("rope_type", "default")
        if rtype not in ("default", "linear"):
            raise HfscaleError(f"rope_type {rtype!r} for {kind} layers is not supported by the GGUF writer "
                               "(supported: default, linear)")
        if rtype == "linear" and kind == "sliding_attention":
            raise HfscaleError("linear rope scaling on sliding layers is not supported by llama.cpp's gemma3")


def _rope(config) -> dict:
    rp = getattr(config, "rope_parameters", None) or {}
    if "full_attention" in rp:
        return rp
    return {"full_attention": rp, "sliding_attention": rp}


def _tensor_type(name: str, shape: tuple, opts: GGUFOptions):
    import gguf

    T = gguf.GGMLQuantizationType
    if len(shape) == 1:
        return T.F32  # norms: tiny, and llama.cpp wants F32 for them
    want = opts.embedding if name == "token_embd.weight" else opts.qtype
    if want in ("Q8_0", "Q4_0") and shape[-1] % 32:
        want = "F16"  # ggml's block types need rows that are multiples of 32
    return T[want]


def _vocab(tokenizer_json: dict):
    """tokens, scores, types for llama.cpp's SPM tokenizer from a byte-fallback BPE."""
    import gguf

    model = tokenizer_json["model"]
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        raise HfscaleError("GGUF export supports a byte-fallback BPE tokenizer (SentencePiece style) only")
    vocab = dict(model["vocab"])
    for t in tokenizer_json.get("added_tokens", []):
        vocab.setdefault(t["content"], t["id"])
    n = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    for s, i in vocab.items():
        tokens[i] = s
    rank = {}
    for r, m in enumerate(model["merges"]):
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        rank.setdefault(a + b, r)
    specials = {t["content"] for t in tokenizer_json.get("added_tokens", []) if t.get("special")}
    unk = model.get("unk_token")
    scores, types = [], []
    for s in tokens:
        # SPM merges the adjacent pair whose result scores highest: -rank reproduces BPE's order
        scores.append(-float(rank[s]) if s in rank else 0.0)
        if s == unk:
            types.append(gguf.TokenType.UNKNOWN)
        elif s in specials:
            types.append(gguf.TokenType.CONTROL)
        elif len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    return tokens, scores, types


def write_gguf(model, tokenizer, out: Path, opts: GGUFOptions, name: str = "", progress: bool = True) -> dict:
    """Write `model` (a Gemma3ForCausalLM, fp32) to `out` atomically. Returns tensor-type counts."""
    import gguf
    import torch

    cfg = model.config
    check_supported(cfg)
    tok_json = json.loads(tokenizer.backend_tokenizer.to_str())
    tokens, scores, types = _vocab(tok_json)

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, arch="gemma3")
        w.add_name(name or "hfscale export")
        w.add_file_type(gguf.LlamaFileType[{"F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0",
                                            "Q4_0": "MOSTLY_Q4_0"}[opts.qtype]])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        rope = _rope(cfg)
        w.add_rope_freq_base(float(rope["full_attention"].get("rope_theta", 1_000_000.0)))
        if rope["full_attention"].get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(rope["full_attention"]["factor"]))
        layer_types = list(cfg.layer_types)
        if "sliding_attention" in layer_types and cfg.sliding_window:
            w.add_sliding_window(cfg.sliding_window)
            w.add_sliding_window_pattern([t == "sliding_attention" for t in layer_types])
            w.add_rope_freq_base_swa(float(rope["sliding_attention"].get("rope_theta", 10_000.0)))
        if getattr(cfg, "final_logit_softcapping", None):
            w.add_final_logit_softcapping(float(cfg.final_logit_softcapping))

        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        vocab = tokenizer.get_vocab()
        for tok_name, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                              ("unk", w.add_unk_token_id), ("pad", w.add_pad_token_id)):
            t = getattr(tokenizer, f"{tok_name}_token", None)
            if t is not None and t in vocab:
                add(vocab[t])
        w.add_add_bos_token(tokenizer("x").input_ids[:1] == [tokenizer.bos_token_id])
        w.add_add_eos_token(False)
        w.add_add_space_prefix(False)  # the normalizer only escapes spaces; nothing is prepended

        names = gguf.TensorNameMap(gguf.MODEL_ARCH.GEMMA3, cfg.num_hidden_layers)
        tied = cfg.tie_word_embeddings
        counts: dict[str, int] = {}
        sd = model.state_dict()
        for hf_name, t in sd.items():
            if hf_name == "lm_head.weight" and tied:
                continue  # llama.cpp reuses token_embd
            gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if gname is None:
                raise HfscaleError(f"no GGUF name for tensor {hf_name!r}; this checkpoint layout is not supported")
            arr = t.detach().to(torch.float32)
            if hf_name.endswith("norm.weight"):
                arr = arr + 1.0  # Gemma RMSNorm: x * (1 + w)
            arr = arr.numpy()
            qt = _tensor_type(gname, arr.shape, opts)
            data = gguf.quants.quantize(arr, qt)
            w.add_tensor(gname, data, raw_dtype=qt)
            counts[qt.name] = counts.get(qt.name, 0) + 1
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=progress)
        w.close()
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return counts
