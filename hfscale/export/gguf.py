"""Write a decoder as GGUF for llama.cpp, with the `gguf` package's GGUFWriter: Gemma 3 and Gemma 4 text
models here, Llama 3.x / Mistral / Qwen 2 / Qwen 3 through the handlers in `gguf_llama` (ARCHS is the
registry; `hfscale quantize --format gguf` accepts exactly its model types).

Common to the Gemma architectures:
- tied embeddings: no `output.weight`; llama.cpp reuses `token_embd` as the output head, so the
  token embedding's type is also the output projection's type (hence its own option).
- tokenizer (every architecture): a byte-level BPE (GPT-2 / Llama 3 / Qwen) is written as llama.cpp's
  "gpt2" vocabulary with the pre-tokenizer read from its structure (`gguf_bpe`). Ours is a BPE over
  "▁"-escaped text with byte fallback (SentencePiece-style, not GPT-2 byte-level), so it is stored
  as llama.cpp's "llama" (SPM) model: merged tokens get score -rank of the merge that creates them,
  bytes are BYTE tokens, no space prefix (other normalizers are refused). Added tokens keep
  how the tokenizer matches them: special ones are CONTROL (matched whole when llama.cpp parses
  specials), the others USER_DEFINED (always matched whole, like transformers does; as NORMAL,
  llama.cpp splits `<start_of_turn>` into pieces). `verify_llama.check_tokenizer` proves the two
  tokenizers agree on held-out text, text with every added token, and chat-template text.
- 1-D tensors (norms, scalars, rope factors) are F32; they are tiny and llama.cpp wants F32.

Gemma 3 — what llama.cpp's gemma3 loader reads (src/models/gemma3.cpp in the vendored llama.cpp):
- hparams: context/embedding/block/ffn lengths, head counts, key/value length (head_dim),
  rms eps, rope base for global layers (`rope.freq_base`) and local ones (`rope.freq_base_swa`),
  `attention.sliding_window` and the per-layer `sliding_window_pattern` as a bool array (without
  it llama.cpp assumes Gemma's 5:1 pattern, wrong for our 3:1 tiny model).
- attention scale: llama.cpp hard-codes 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 62-layer
  27B), so a config whose `query_pre_attn_scalar` differs is refused rather than exported wrong.
- norms: Gemma 3's RMSNorm computes x·(1 + w); llama.cpp multiplies by the stored weight, so we
  store 1 + w.

Gemma 4 — see `_hparams_gemma4` and `_check_gemma4` for the llama.cpp side of each convention.
Gemma 4 MoE (26B-A4B's block) — see `_check_gemma4_moe`: packed experts are written as they are
(`ffn_gate_up_exps` [E, 2I, H], `ffn_down_exps` [E, H, I]), the router's input scale and per-expert
scales under llama.cpp's `.scale` names, the router F32. Verified in llama.cpp (llama-cpp-python
0.3.36) on a tiny trained 26B-A4B shape: tests/test_export_gguf_moe.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from ..compress.schemes import default_embed_qtype
from . import gguf_bpe
from . import gguf_llama as L
from ..util.errors import HfscaleError, first_line

QTYPES = ("F16", "BF16", "Q8_0", "Q4_0")
EMBED_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
# large lookup tables: llama.cpp's quantizer gives both the --token-embedding-type (llama-quant.cpp,
# tensor_name_match_token_embd), so they follow GGUFOptions.embedding here too
EMBEDDING_TENSORS = ("token_embd.weight", "per_layer_token_embd.weight")
GEMMA4_SUPPORTED = ("Gemma 4 text decoders: sliding + full attention, per-layer embeddings, shared KV, "
                    "k=v attention, double-wide MLP, default/proportional RoPE, 26B-A4B-style mixture of experts")


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
    """Refuse, in one line, configs llama.cpp's graph for the architecture would run wrongly."""
    mt = getattr(config, "model_type", None)
    if mt not in ARCHS:
        why = (" (for a multimodal Gemma 4 checkpoint, export its text decoder as Gemma4ForCausalLM)"
               if mt == "gemma4" else "")
        raise HfscaleError(f"GGUF export supports model types {', '.join(ARCHS)} "
                           f"(Gemma 3 / Gemma 4 text, Llama 3.x, Mistral, Qwen 2 / 3), not {mt!r}{why}")
    ARCHS[mt].check(config)


def norm_convention(config) -> str:
    """How RMSNorm weights are stored, in words (for the sidecar)."""
    if ARCHS[config.model_type].norm_offset:
        return "F32, stored as 1 + w (Gemma 3 RMSNorm)"
    return "F32, stored as w (the RMSNorm multiplies by w)"


# --------------------------------------------------------------------------------------- Gemma 3

def _check_gemma3(config) -> None:
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


def _hparams_gemma3(w, cfg) -> None:
    import gguf

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


# --------------------------------------------------------------------------------------- Gemma 4

class _Layer(NamedTuple):
    sliding: bool
    head_dim: int
    n_kv_heads: int
    n_ff: int


def _gemma4_layers(cfg) -> list[_Layer]:
    """Each layer's shape as transformers' Gemma4 resolves it: `per_layer_config` gives full layers
    their `global_head_dim` (and `num_global_key_value_heads` with attention_k_eq_v); with
    `use_double_wide_mlp`, layers that reuse another layer's KV get a 2x intermediate size."""
    modes = cfg.kv_sharing_modes
    double = bool(getattr(cfg, "use_double_wide_mlp", False))
    return [_Layer(sliding=t == "sliding_attention",
                   head_dim=int(cfg.per_layer_config[i].head_dim),
                   n_kv_heads=int(cfg.per_layer_config[i].num_key_value_heads),
                   n_ff=cfg.intermediate_size * (2 if double and modes[i] == "reuse" else 1))
            for i, t in enumerate(cfg.layer_types)]


def _gemma4_error(problem: str) -> HfscaleError:
    return HfscaleError(f"{problem}; the GGUF writer supports {GEMMA4_SUPPORTED}")


def _check_gemma4_rope(cfg) -> None:
    """Sliding layers: plain RoPE over the whole head. Full layers: plain or "proportional" RoPE
    (the rotated part is encoded in `rope_freqs.weight`, see `_gemma4_rope_freqs`). Position scaling
    (`factor`) has no counterpart in what llama.cpp's gemma4 graph reads, so it is refused."""
    rp = cfg.rope_parameters or {}
    for kind, allowed in (("sliding_attention", ("default",)), ("full_attention", ("default", "proportional"))):
        p = rp.get(kind) or {}
        rtype = p.get("rope_type", "default")
        if rtype not in allowed:
            raise _gemma4_error(f"rope_type {rtype!r} on {kind} layers is not supported (there: {', '.join(allowed)})")
        if float(p.get("factor", 1.0)) != 1.0:
            raise _gemma4_error(f"RoPE scaling factor {p['factor']} on {kind} layers is not supported")
        if rtype == "default" and float(p.get("partial_rotary_factor", 1.0)) != 1.0:
            raise _gemma4_error(f"partial_rotary_factor with default RoPE on {kind} layers is not supported")


def _check_gemma4_kv_sharing(cfg, layers: list[_Layer]) -> None:
    """llama.cpp (llama-model.cpp, the gemma3n/gemma4 `reuse` callback) gives every KV-sharing layer
    the cache of layer first_shared-2 if it is sliding, first_shared-1 if it is full; transformers
    gives it the last non-sharing layer of its own type. Those agree iff the two layers just before
    the shared block are sliding, then full: the layout llama.cpp's rule was written for (Gemma 3n,
    Gemma 4 E2B/E4B)."""
    n_shared = cfg.num_kv_shared_layers or 0
    if not n_shared:
        return
    first = cfg.num_hidden_layers - n_shared
    if first < 2 or not (layers[first - 2].sliding and not layers[first - 1].sliding):
        raise _gemma4_error(f"num_kv_shared_layers={n_shared} needs the two layers before the shared block to be "
                            "sliding then full (llama.cpp reuses exactly those two caches)")


def _check_gemma4_moe(cfg) -> None:
    """llama.cpp's gemma4 MoE block (src/models/gemma4.cpp: build_moe_ffn with softmax gating, weight
    normalisation on, scale 1.0) routes as transformers' Gemma4TextRouter does: softmax over all experts
    of proj(rms_norm(h) * scale / sqrt(hidden)), top-k, renormalised to sum 1, times per_expert_scale
    (llama.cpp multiplies each expert's output by `ffn_down_exps.scale`: the same, as the expert is
    linear in its weight). The shared MLP and the three extra norms are read as transformers has them.
    What the graph cannot express is refused."""
    n, k = int(cfg.num_experts or 0), int(cfg.top_k_experts or 0)
    if not 0 < k <= n:
        raise _gemma4_error(f"top_k_experts={k} must be between 1 and num_experts={n}")


def _check_gemma4(cfg) -> None:
    """Refuse what llama.cpp's gemma4 graph (src/models/gemma4.cpp) would compute differently."""
    if getattr(cfg, "enable_moe_block", False):
        _check_gemma4_moe(cfg)
    if cfg.attention_bias:
        raise _gemma4_error("attention_bias=True is not supported (llama.cpp's gemma4 loads no attention biases)")
    if cfg.hidden_activation != "gelu_pytorch_tanh":
        raise _gemma4_error(f"hidden_activation {cfg.hidden_activation!r} is not supported "
                            "(llama.cpp's gemma4 uses tanh-approximated GELU: gelu_pytorch_tanh)")
    if cfg.use_bidirectional_attention == "all":
        raise _gemma4_error("use_bidirectional_attention='all' is not supported "
                            "(llama.cpp's gemma4 text path is causal)")
    if cfg.hidden_size_per_layer_input and cfg.vocab_size_per_layer_input != cfg.vocab_size:
        raise _gemma4_error(f"vocab_size_per_layer_input={cfg.vocab_size_per_layer_input} != vocab_size="
                            f"{cfg.vocab_size} is not supported "
                            "(llama.cpp sizes the per-layer table by the vocabulary)")
    try:
        layers = _gemma4_layers(cfg)
    except (ValueError, KeyError, AttributeError) as e:
        first = first_line(e)
        raise _gemma4_error(f"cannot resolve the per-layer shapes of this config ({first})") from None
    if not any(lay.sliding for lay in layers):
        raise _gemma4_error("a config without sliding-attention layers is not supported "
                            "(llama.cpp's gemma4 cache needs some)")
    for sliding in (True, False):
        dims = {lay.head_dim for lay in layers if lay.sliding == sliding}
        if len(dims) > 1:
            kind = "sliding" if sliding else "full"
            raise _gemma4_error(f"{kind} layers with different head sizes {sorted(dims)} are not supported "
                                "(llama.cpp has one head size for sliding and one for full layers)")
    _check_gemma4_rope(cfg)
    _check_gemma4_kv_sharing(cfg, layers)


def _gemma4_rope_freqs(cfg) -> np.ndarray:
    """`rope_freqs.weight`, the per-frequency divisors llama.cpp applies on full-attention layers.

    transformers' "proportional" RoPE (modeling_rope_utils) rotates the first
    int(partial_rotary_factor * head_dim // 2) frequency pairs at base^(-2i/head_dim) and gives the
    remaining pairs frequency 0 (cos 1, sin 0: left as they are). llama.cpp rotates the whole head
    (n_rot = head_dim, same base^(-2i/head_dim)) and divides each pair's angle by this tensor: 1 keeps
    a pair, 1e30 makes its angle 0. This is the encoding of llama.cpp's own converter
    (conversion/gemma.py, Gemma4Model.generate_extra_tensors). Plain RoPE rotates every pair: all 1.
    The tensor is required by llama.cpp's gemma4 loader either way.
    """
    full = next(lay for lay in _gemma4_layers(cfg) if not lay.sliding)
    p = cfg.rope_parameters["full_attention"]
    half = full.head_dim // 2
    rotated = half
    if p.get("rope_type") == "proportional":
        rotated = int(float(p.get("partial_rotary_factor", 1.0)) * full.head_dim // 2)
    return np.array([1.0] * rotated + [1e30] * (half - rotated), dtype=np.float32)


def _hparams_gemma4(w, cfg) -> None:
    """The metadata llama.cpp's gemma4 loader reads (llama-model.cpp generic keys, then
    src/models/gemma4.cpp `load_arch_hparams`):
    - two head sizes: `attention.key_length`/`value_length` (and `rope.dimension_count`) are the
      full layers' head size, the `_swa` variants the sliding layers'; `attention.head_count_kv`
      becomes a per-layer array when full layers have their own KV head count.
    - `feed_forward_length` becomes a per-layer array with the double-wide MLP.
    - `attention.sliding_window_pattern` (required), `attention.sliding_window` (required),
      `rope.freq_base` for full layers, `rope.freq_base_swa` for sliding ones.
    - `attention.shared_kv_layers`: the last N layers read earlier layers' KV (see
      `_check_gemma4_kv_sharing`).
    - `embedding_length_per_layer_input` (required; 0 = no per-layer embeddings). The graph scales
      the per-layer table by sqrt(that), the model projection by 1/sqrt(hidden), the sum by
      1/sqrt(2), as transformers' Gemma4TextModel does.
    - attention scale: nothing to write; both sides use 1.0 (the q/k norms carry the scale).
    - norms: Gemma4RMSNorm multiplies by w itself (no 1 + w), and v_norm has no weight; llama.cpp
      rms-normalizes V without one, so weights are stored as they are.
    """
    layers = _gemma4_layers(cfg)
    full = next(lay for lay in layers if not lay.sliding)
    swa = next(lay for lay in layers if lay.sliding)
    rope = cfg.rope_parameters

    def per_layer(values: list[int]):
        return values[0] if len(set(values)) == 1 else values

    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(per_layer([lay.n_ff for lay in layers]))
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(per_layer([lay.n_kv_heads for lay in layers]))
    w.add_key_length(full.head_dim)
    w.add_value_length(full.head_dim)
    w.add_key_length_swa(swa.head_dim)
    w.add_value_length_swa(swa.head_dim)
    w.add_rope_dimension_count(full.head_dim)
    w.add_rope_dimension_count_swa(swa.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
    w.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
    w.add_sliding_window(cfg.sliding_window)
    w.add_sliding_window_pattern([lay.sliding for lay in layers])
    w.add_shared_kv_layers(int(cfg.num_kv_shared_layers or 0))
    w.add_embedding_length_per_layer_input(int(cfg.hidden_size_per_layer_input or 0))
    if getattr(cfg, "enable_moe_block", False):  # every layer: shared MLP (feed_forward_length) + experts
        w.add_expert_count(int(cfg.num_experts))
        w.add_expert_used_count(int(cfg.top_k_experts))
        w.add_expert_feed_forward_length(int(cfg.moe_intermediate_size))
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(float(cfg.final_logit_softcapping))


# ------------------------------------------------------------------------------------ the registry

@dataclass(frozen=True)
class _Arch:
    gguf_arch: str                      # gguf.MODEL_ARCH member name
    check: Callable
    hparams: Callable                   # (GGUFWriter, config) -> None
    norm_offset: float                  # added to every `*norm.weight` before writing
    extra_tensors: Callable = lambda cfg: {}  # GGUF name -> F32 array, tensors transformers has no parameter for
    transform: Callable = lambda hf_name, arr, cfg: arr  # layout changes (the llama arch's q/k row order)


ARCHS: dict[str, _Arch] = {
    "gemma3_text": _Arch("GEMMA3", _check_gemma3, _hparams_gemma3, norm_offset=1.0),
    "gemma4_text": _Arch("GEMMA4", _check_gemma4, _hparams_gemma4, norm_offset=0.0,
                         extra_tensors=lambda cfg: {"rope_freqs.weight": _gemma4_rope_freqs(cfg)}),
    **{mt: _Arch(arch, L.check, L.hparams, norm_offset=0.0, extra_tensors=L.rope_freqs, transform=L.transform)
       for mt, arch in L.FAMILIES.items()},
}


def _tensor_type(name: str, shape: tuple, opts: GGUFOptions):
    import gguf

    T = gguf.GGMLQuantizationType
    if len(shape) == 1 or name.endswith(F32_TENSORS):
        return T.F32  # norms, layer scalars, rope factors: tiny, and llama.cpp wants F32 for them; routers
    want = opts.embedding if name in EMBEDDING_TENSORS else opts.qtype
    if want in ("Q8_0", "Q4_0") and shape[-1] % 32:
        want = "F16"  # ggml's block types need rows that are multiples of 32
    return T[want]


# Gemma 4 MoE tensors gguf 0.19's TensorNameMap has no entry for, named as llama.cpp's gemma4 loader
# looks them up (tn(LLM_TENSOR_FFN_GATE_INP, "scale", i), tn(LLM_TENSOR_FFN_DOWN_EXPS, "scale", i))
EXTRA_NAMES = {
    re.compile(r"model\.layers\.(\d+)\.router\.scale"): "blk.{}.ffn_gate_inp.scale",
    re.compile(r"model\.layers\.(\d+)\.router\.per_expert_scale"): "blk.{}.ffn_down_exps.scale",
}
# MoE routers stay F32 at every qtype, as llama.cpp's converter and llama-quantize keep them: top-k
# selection flips on perturbations far below Q8_0's rounding, and the tensor is n_embd x n_expert only
F32_TENSORS = ("ffn_gate_inp.weight",)


def _gguf_name(names, hf_name: str) -> str:
    """GGUF tensor name; parameters without a suffix (Gemma 4's `layer_scalar` buffer) get
    `.weight`, which is how llama.cpp looks them up (`blk.N.layer_output_scale.weight`)."""
    for rx, template in EXTRA_NAMES.items():
        m = rx.fullmatch(hf_name)
        if m:
            return template.format(m.group(1))
    gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if gname is None:
        raise HfscaleError(f"no GGUF name for tensor {hf_name!r}; this checkpoint layout is not supported")
    return gname if gname.endswith((".weight", ".bias")) else gname + ".weight"


def added_tokens(tokenizer) -> dict[str, bool]:
    """content -> special, for every token the tokenizer adds on top of its model's vocabulary.

    Read from the tokenizer object (transformers 5.24 no longer writes `added_tokens_decoder` to
    tokenizer_config.json), then from its tokenizer.json `added_tokens` for anything not listed there."""
    found = {t.content: bool(t.special) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    for t in json.loads(tokenizer.backend_tokenizer.to_str()).get("added_tokens", []):
        found.setdefault(t["content"], bool(t.get("special")))
    return found


def _vocab(tokenizer_json: dict, added: dict[str, bool], n_vocab: int):
    """tokens, scores, types for llama.cpp's SPM tokenizer from a byte-fallback BPE; `added`: see added_tokens.
    The list has one entry per embedding row (`n_vocab`; llama.cpp requires it): unused ids are [PADi]."""
    import gguf

    model = tokenizer_json["model"]
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        raise HfscaleError("GGUF export supports a byte-fallback BPE tokenizer (SentencePiece style) only")
    vocab = dict(model["vocab"])
    for t in tokenizer_json.get("added_tokens", []):
        vocab.setdefault(t["content"], t["id"])
    n = max(vocab.values()) + 1
    if n > n_vocab:
        raise HfscaleError(f"the tokenizer has ids up to {n - 1} but the model's embedding has {n_vocab} rows; "
                           "resize it (model.resize_token_embeddings(len(tokenizer))) and save the model again")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    for s, i in vocab.items():
        tokens[i] = s
    rank = {}
    for r, m in enumerate(model["merges"]):
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        rank.setdefault(a + b, r)
    unk = model.get("unk_token")
    scores, types = [], []
    for s in tokens:
        # SPM merges the adjacent pair whose result scores highest: -rank reproduces BPE's order
        scores.append(-float(rank[s]) if s in rank else 0.0)
        if s == unk:
            types.append(gguf.TokenType.UNKNOWN)
        elif s in added:
            types.append(gguf.TokenType.CONTROL if added[s] else gguf.TokenType.USER_DEFINED)
        elif len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    return tokens, scores, types


def _spm_text_handling(tokenizer_json: dict) -> None:
    """The SPM path reproduces a normalizer that only escapes spaces as "▁" (nothing prepended): refuse others."""
    norm = tokenizer_json.get("normalizer") or {}
    if not (norm.get("type") == "Replace" and norm.get("pattern") == {"String": " "} and norm.get("content") == "\u2581"):
        raise HfscaleError(f"tokenizer: normalizer {norm.get('type')!r} is not the space-to-'\u2581' Replace the GGUF "
                           "writer reproduces for a byte-fallback BPE; llama.cpp would tokenize differently")


def check_tokenizer(tokenizer) -> None:
    """Refuse, before anything is written, a tokenizer llama.cpp would split differently (see _add_tokenizer)."""
    tj = json.loads(tokenizer.backend_tokenizer.to_str())
    if gguf_bpe.is_byte_level(tj):
        gguf_bpe.check(tj)
    else:
        _spm_text_handling(tj)


def _add_tokenizer(w, tokenizer, n_vocab: int) -> None:
    tj = json.loads(tokenizer.backend_tokenizer.to_str())
    if gguf_bpe.is_byte_level(tj):
        gguf_bpe.add_vocab(w, tokenizer, tj, added_tokens(tokenizer), n_vocab)
    else:
        _spm_text_handling(tj)
        tokens, scores, types = _vocab(tj, added_tokens(tokenizer), n_vocab)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_add_space_prefix(False)  # the normalizer only escapes spaces; nothing is prepended
    vocab = tokenizer.get_vocab()
    for tok_name, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                          ("unk", w.add_unk_token_id), ("pad", w.add_pad_token_id)):
        t = getattr(tokenizer, f"{tok_name}_token", None)
        if t is not None and t in vocab:
            add(vocab[t])
    ids = tokenizer("x").input_ids
    w.add_add_bos_token(tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id])
    w.add_add_eos_token(tokenizer.eos_token_id is not None and ids[-1:] == [tokenizer.eos_token_id])


def _tensors(model, arch: _Arch):
    """(GGUF name, fp32 array) for every tensor to write, in the model's order, then the extras."""
    import gguf
    import torch

    cfg = model.config
    names = gguf.TensorNameMap(gguf.MODEL_ARCH[arch.gguf_arch], cfg.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp reuses token_embd
        arr = t.detach().to(torch.float32)
        if arch.norm_offset and hf_name.endswith("norm.weight"):
            arr = arr + arch.norm_offset
        yield _gguf_name(names, hf_name), arch.transform(hf_name, arr.numpy(), cfg)
    yield from arch.extra_tensors(cfg).items()


def write_gguf(model, tokenizer, out: Path, opts: GGUFOptions, name: str = "", progress: bool = True) -> dict:
    """Write `model` (a causal LM of a model type in ARCHS, fp32) to the file `out` (callers that
    publish it stage it: export.artifacts). Returns tensor-type counts."""
    import gguf

    cfg = model.config
    check_supported(cfg)
    arch = ARCHS[cfg.model_type]

    w = gguf.GGUFWriter(Path(out), arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch.gguf_arch]])
    w.add_name(name or "hfscale export")
    w.add_file_type(gguf.LlamaFileType[{"F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0",
                                        "Q4_0": "MOSTLY_Q4_0"}[opts.qtype]])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    arch.hparams(w, cfg)
    _add_tokenizer(w, tokenizer, cfg.vocab_size)

    counts: dict[str, int] = {}
    for gname, arr in _tensors(model, arch):
        qt = _tensor_type(gname, arr.shape, opts)
        w.add_tensor(gname, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        counts[qt.name] = counts.get(qt.name, 0) + 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=progress)
    w.close()
    return counts
