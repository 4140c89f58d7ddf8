"""GGUF handlers for the Llama-shaped decoders `hfscale prune` supports: Llama 3.x and Mistral (llama.cpp's
`llama` architecture), Qwen 2 / 2.5 (`qwen2`) and Qwen 3 dense (`qwen3`). Registered in `gguf.ARCHS`.

What llama.cpp's loaders and graphs read (src/llama-model.cpp, src/models/{llama,qwen2,qwen3}.cpp):
- tensors: `token_embd`, `blk.N.attn_{norm,q,k,v,output}`, `blk.N.ffn_{norm,gate,up,down}`, `output_norm`,
  and `output` when the head is not tied (llama.cpp falls back to `token_embd` when it is absent);
  Qwen 2's q/k/v biases (`blk.N.attn_{q,k,v}.bias`), Qwen 3's per-head q/k RMSNorms (`attn_{q,k}_norm`).
- RoPE layout: transformers rotates the two halves of each head (rotate_half). llama.cpp's qwen2 / qwen3
  use that layout too (NEOX rope), but its `llama` graph rotates adjacent pairs (NORM rope), so for Llama
  and Mistral the rows of q_proj / k_proj (and a LoRA's lora_B for them) are reordered per head: row
  (h, half j, i) moves to (h, i, j) — `permute_qk`.
- hparams: context / embedding / block / FFN lengths, head counts (GQA: head_count_kv), key/value length
  (head_dim, which Qwen 3 sets apart from hidden/heads), rope dimension = head_dim, RMS eps, rope base
  (`rope.freq_base`). RoPE scaling: "linear" as `rope.scaling.type` linear + factor; Llama 3.x's "llama3"
  as the `rope_freqs.weight` tensor (llama.cpp divides each frequency's angle by it): here the ratio of
  transformers' own default and llama3 inverse frequencies, so the two compute the same angles.
- attention scale 1/sqrt(head_dim) and SiLU-gated MLP on both sides.

Refused in one line, naming the setting (llama.cpp would compute something else): other RoPE kinds (yarn,
dynamic, longrope), partial rotary, sliding windows (llama.cpp's llama / qwen graphs attend to the whole
context), biases other than Qwen 2's q/k/v, activations other than SiLU, llama3 RoPE outside the llama arch.
"""

from __future__ import annotations

import numpy as np

from ..util.errors import HfscaleError

FAMILIES = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}
ROPE_KINDS = {"llama": ("default", "linear", "llama3"), "mistral": ("default", "linear", "llama3"),
              "qwen2": ("default", "linear"), "qwen3": ("default", "linear")}


def _refuse(cfg, problem: str) -> HfscaleError:
    return HfscaleError(f"{cfg.model_type}: {problem}; llama.cpp's {FAMILIES[cfg.model_type].lower()} graph "
                        "would compute something else, so it is not exported to GGUF")


def head_dim(cfg) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _rope(cfg) -> dict:
    return dict(getattr(cfg, "rope_parameters", None) or {})


def check(cfg) -> None:
    mt = cfg.model_type
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise _refuse(cfg, f"hidden_act={act!r} (llama.cpp uses SiLU)")
    if mt != "qwen2" and getattr(cfg, "attention_bias", False):
        raise _refuse(cfg, "attention_bias=True")
    if getattr(cfg, "mlp_bias", False):
        raise _refuse(cfg, "mlp_bias=True")
    rp = _rope(cfg)
    kind = rp.get("rope_type", "default")
    if kind not in ROPE_KINDS[mt]:
        raise _refuse(cfg, f"rope_type {kind!r} (supported for {mt}: {', '.join(ROPE_KINDS[mt])})")
    if float(rp.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _refuse(cfg, f"partial_rotary_factor={rp['partial_rotary_factor']}")
    if mt == "mistral" and cfg.sliding_window is not None and cfg.sliding_window < cfg.max_position_embeddings:
        raise _refuse(cfg, f"sliding_window={cfg.sliding_window} < max_position_embeddings="
                           f"{cfg.max_position_embeddings} (set sliding_window=None, as Mistral v0.2+ does)")
    if mt in ("qwen2", "qwen3"):
        if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
            raise _refuse(cfg, "use_sliding_window=True")
    hd = head_dim(cfg)
    if hd % 2:
        raise _refuse(cfg, f"head_dim={hd} is odd")


def hparams(w, cfg) -> None:
    import gguf

    hd = head_dim(cfg)
    rp = _rope(cfg)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads or cfg.num_attention_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(rp.get("rope_theta", 10_000.0)))
    if rp.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rp["factor"]))


def rope_freqs(cfg) -> dict:
    """{"rope_freqs.weight": divisors} for llama3 RoPE, else nothing: transformers' default inverse
    frequencies over its llama3 ones (modeling_rope_utils.ROPE_INIT_FUNCTIONS), per frequency pair."""
    if _rope(cfg).get("rope_type") != "llama3":
        return {}
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hd = head_dim(cfg)
    base = float(_rope(cfg)["rope_theta"])
    default = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    return {"rope_freqs.weight": (default / scaled.double()).numpy().astype(np.float32)}


def permute_qk(arr: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of a q/k projection (or its LoRA B, or bias) from transformers' half-split RoPE layout to the
    adjacent-pair layout llama.cpp's `llama` graph rotates: per head, [first half; second half] interleaved."""
    rows = arr.shape[0]
    return arr.reshape(n_heads, 2, rows // n_heads // 2, *arr.shape[1:]).swapaxes(1, 2).reshape(arr.shape)


def transform(hf_name: str, arr: np.ndarray, cfg) -> np.ndarray:
    """The row reordering of q_proj / k_proj weights (and LoRA B factors of them) for the `llama` arch."""
    if FAMILIES[cfg.model_type] != "LLAMA":
        return arr
    if ".self_attn.q_proj." in hf_name:
        return permute_qk(arr, cfg.num_attention_heads)
    if ".self_attn.k_proj." in hf_name:
        return permute_qk(arr, cfg.num_key_value_heads or cfg.num_attention_heads)
    return arr
