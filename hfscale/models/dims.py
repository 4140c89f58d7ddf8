"""The dimensions of a decoder-only LM, read from its transformers config, and its exact parameter count.

Gemma 3, Llama, Mistral and Qwen2 repeat one decoder layer, so a handful of integers describe them.
Gemma 4 (transformers' `Gemma4TextConfig`, model_type gemma4_text) varies per layer, so `Dims.per_layer`
holds one `LayerDims` for each layer (read from `config.per_layer_config` / `config.kv_sharing_modes`):
  - head size and K/V heads differ by attention type: sliding layers use `head_dim` / `num_key_value_heads`,
    full layers `global_head_dim` / (`num_global_key_value_heads` when `attention_k_eq_v`);
  - the last `num_kv_shared_layers` layers have no k/v projections: each reuses the keys/values of the last
    earlier layer of its attention type ("store" -> "reuse" in `kv_sharing_modes`);
  - `attention_k_eq_v`: full layers have no v_proj, the values are the (un-normed) key projection;
  - `use_double_wide_mlp`: KV-shared layers have an MLP of 2 x intermediate_size;
  - per-layer inputs (PLE, `hidden_size_per_layer_input` p > 0): one packed embedding of
    vocab_size_per_layer_input x (layers * p), a hidden -> layers*p projection + RMSNorm(p), and per layer a
    gate h->p, a projection p->h and an RMSNorm(h);
  - `enable_moe_block`: every layer adds, beside its dense MLP, a router (RMSNorm without scale,
    Linear h->E, scale h, per_expert_scale E), E experts of a GeGLU of width `moe_intermediate_size`
    (gate_up E x 2I' x h, down E x h x I') and three RMSNorms.
Parameter counts are exact (checked against sum(p.numel()) of the transformers model in tests/test_plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..util.errors import HfscaleError

# families whose decoder layer the activation model knows (HF implementations, counted tensor by tensor)
GEMMA = ("gemma3_text", "gemma3")
GEMMA4 = ("gemma4_text", "gemma4")
LLAMA_LIKE = ("llama", "mistral", "qwen2")
ATTENTION_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class LayerDims:
    """One Gemma 4 decoder layer (the uniform families leave Dims.per_layer empty)."""

    attention: str  # sliding_attention | full_attention
    head_dim: int
    kv_heads: int
    intermediate: int  # dense MLP width (2 x intermediate_size on KV-shared layers with use_double_wide_mlp)
    kv_source: int = -1  # >= 0: reuses the keys/values of that earlier layer (no k/v projections, no KV cache)
    k_eq_v: bool = False  # values are the key projection (no v_proj)
    moe: bool = False  # router + experts beside the dense MLP

    def __post_init__(self):
        if self.attention not in ATTENTION_TYPES:
            raise HfscaleError(f"layer attention type must be one of {', '.join(ATTENTION_TYPES)} (got {self.attention!r}); "
                               "fix layer_types in the config")
        if min(self.head_dim, self.kv_heads, self.intermediate) < 1:
            raise HfscaleError("layer head_dim, kv_heads and intermediate must be positive; fix the model config")

    @property
    def kv_shared(self) -> bool:
        return self.kv_source >= 0


@dataclass(frozen=True)
class Dims:
    family: str  # "gemma", "gemma4" or "llama"
    model_type: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    final_softcap: float | None = None  # tanh soft-capping of the logits (saves the T x V tanh output)
    # --- Gemma 4 only ---
    per_layer: tuple[LayerDims, ...] = ()
    ple_dim: int = 0  # hidden_size_per_layer_input (0: no per-layer inputs)
    ple_vocab: int = 0  # vocab_size_per_layer_input
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0

    def __post_init__(self):
        if self.family not in ("gemma", "gemma4", "llama"):
            raise HfscaleError(f"unknown model family {self.family!r}; use gemma, gemma4 or llama")
        if min(self.vocab, self.hidden, self.intermediate, self.layers, self.heads, self.kv_heads, self.head_dim) < 1:
            raise HfscaleError("vocab, hidden, intermediate, layers, heads, kv_heads and head_dim must be positive; fix the model config")
        if self.per_layer and len(self.per_layer) != self.layers:
            raise HfscaleError(f"per_layer has {len(self.per_layer)} entries for {self.layers} layers; give one LayerDims per layer")
        if self.family == "gemma4" and not self.per_layer:
            raise HfscaleError("gemma4 dims need per_layer (one LayerDims per layer); build them with dims_from_config")
        if self.ple_dim < 0 or (self.ple_dim and self.ple_vocab < 1):
            raise HfscaleError("per-layer inputs need hidden_size_per_layer_input >= 0 and vocab_size_per_layer_input >= 1")
        if any(ld.moe for ld in self.per_layer) and not (self.experts >= self.top_k >= 1 and self.moe_intermediate >= 1):
            raise HfscaleError("MoE layers need num_experts >= top_k_experts >= 1 and moe_intermediate_size >= 1; fix the config")

    # --- parameter counts (exact for these architectures) ---
    @property
    def attn_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        n = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            n += q + 2 * kv
        if self.family == "gemma":
            n += 2 * self.head_dim  # q_norm, k_norm
        return n

    @property
    def mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate  # gate, up, down

    @property
    def layer_params(self) -> int:
        """One decoder layer of a uniform family (Gemma 4: the largest layer)."""
        if self.per_layer:
            return max(self.layer_param_counts)
        norms = (4 if self.family == "gemma" else 2) * self.hidden
        return self.attn_params + self.mlp_params + norms

    def layer_attn_params(self, i: int) -> int:
        """Gemma 4 attention of layer i: q_proj + q_norm(d) + o_proj, and unless KV-shared k_proj + k_norm(d)
        + v_proj (absent with k_eq_v); v_norm has no weight. Biases when attention_bias."""
        ld, h = self.per_layer[i], self.hidden
        q, kv, b = self.heads * ld.head_dim, ld.kv_heads * ld.head_dim, self.qkv_bias
        n = (h * q + q * b) + ld.head_dim + (q * h + h * b)  # q_proj, q_norm, o_proj
        if not ld.kv_shared:
            n += (h * kv + kv * b) + ld.head_dim  # k_proj, k_norm
            if not ld.k_eq_v:
                n += h * kv + kv * b  # v_proj
        return n

    def layer_moe_params(self, i: int) -> int:
        """Router: proj h x E + scale h + per_expert_scale E; experts: gate_up E x 2I' x h + down E x h x I';
        norms post_feedforward_layernorm_1/2, pre_feedforward_layernorm_2: 3h."""
        if not self.per_layer[i].moe:
            return 0
        h, E = self.hidden, self.experts
        return (h * E + h + E) + 3 * E * h * self.moe_intermediate + 3 * h

    @property
    def layer_param_counts(self) -> tuple[int, ...]:
        if not self.per_layer:
            return (self.layer_params,) * self.layers
        h, p = self.hidden, self.ple_dim
        out = []
        for i, ld in enumerate(self.per_layer):
            n = self.layer_attn_params(i) + 3 * h * ld.intermediate + 4 * h  # attention, GeGLU MLP, 4 RMSNorms
            if p:
                n += 2 * h * p + h  # per_layer_input_gate h->p, per_layer_projection p->h, post_per_layer_input_norm
            out.append(n + self.layer_moe_params(i))
        return tuple(out)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def ple_params(self) -> int:
        """Per-layer inputs outside the layers: the packed embedding V' x (layers * p), the projection
        h -> layers * p and its RMSNorm(p). Zero without PLE."""
        if not self.ple_dim:
            return 0
        lp = self.layers * self.ple_dim
        return self.ple_vocab * lp + self.hidden * lp + self.ple_dim

    @property
    def ple_embedding_params(self) -> int:
        return self.ple_vocab * self.layers * self.ple_dim if self.ple_dim else 0

    @property
    def params(self) -> int:
        head = 0 if self.tied else self.vocab * self.hidden
        return self.embedding_params + sum(self.layer_param_counts) + self.hidden + head + self.ple_params

    @property
    def largest_layer_params(self) -> int:
        """The largest single module ZeRO-3 must gather at once (the embedding, for Gemma's 262k vocab;
        Gemma 4's packed per-layer embedding when present; one layer's experts for MoE)."""
        if not self.per_layer:
            return max(self.embedding_params, self.attn_params, self.mlp_params)
        mods = [self.embedding_params, self.ple_embedding_params]
        for i, ld in enumerate(self.per_layer):
            mods += [self.layer_attn_params(i), 3 * self.hidden * ld.intermediate]
            if ld.moe:
                mods.append(3 * self.experts * self.hidden * self.moe_intermediate)
        return max(mods)

    def layers_dims(self) -> tuple[LayerDims, ...]:
        """One LayerDims per layer for every family (uniform families repeat theirs)."""
        if self.per_layer:
            return self.per_layer
        types = self.layer_types or ("full_attention",) * self.layers
        return tuple(LayerDims(t if t in ATTENTION_TYPES else "full_attention", self.head_dim, self.kv_heads, self.intermediate)
                     for t in types[: self.layers])


def _gemma4_layers(text) -> tuple[LayerDims, ...]:
    """Per-layer dims of a Gemma4TextConfig, from the resolved per-layer config (head_dim and K/V heads by
    attention type) and kv_sharing_modes (transformers' own rule: the last num_kv_shared_layers layers "reuse"
    the K/V of the last earlier layer of the same attention type, the "store" one)."""
    n = text.num_hidden_layers
    types = list(text.layer_types or [])
    if len(types) < n:
        raise HfscaleError(f"gemma4 config has {len(types)} layer_types for {n} layers; give one per layer")
    per = getattr(text, "per_layer_config", None)
    try:
        modes = list(text.kv_sharing_modes)
    except (AttributeError, ValueError) as e:
        raise HfscaleError(f"cannot resolve Gemma 4 KV sharing ({e}); fix num_kv_shared_layers / layer_types") from None
    first_shared = n - (text.num_kv_shared_layers or 0)
    out = []
    for i in range(n):
        lc = per[i] if per is not None else text
        kv_source = -1
        if modes[i] == "reuse":
            earlier = [j for j in range(min(i, first_shared)) if types[j] == types[i]]
            kv_source = earlier[-1] if earlier else -1
            if kv_source < 0:
                raise HfscaleError(f"gemma4 layer {i} shares K/V but no earlier {types[i]} layer produces them; fix num_kv_shared_layers")
        full = types[i] == "full_attention"
        out.append(LayerDims(
            attention=types[i],
            head_dim=lc.head_dim,
            kv_heads=lc.num_key_value_heads,
            intermediate=text.intermediate_size * (2 if text.use_double_wide_mlp and kv_source >= 0 else 1),
            kv_source=kv_source,
            k_eq_v=bool(text.attention_k_eq_v) and full,
            moe=bool(text.enable_moe_block),
        ))
    return tuple(out)


def dims_from_config(config) -> Dims:
    text = getattr(config, "text_config", None) or config
    mt = getattr(text, "model_type", "")
    if mt in GEMMA:
        family = "gemma"
    elif mt in GEMMA4:
        family = "gemma4"
    elif mt in LLAMA_LIKE:
        family = "llama"
    else:
        raise HfscaleError(f"no memory model for model_type {mt!r}; supported: {', '.join(GEMMA + GEMMA4 + LLAMA_LIKE)}")
    heads = text.num_attention_heads
    extra: dict = {}
    if family == "gemma4":
        # head_dim / num_key_value_heads vary per layer (transformers refuses the global attribute): keep the
        # config's global values (the sliding layers') in the scalar fields, the truth in per_layer
        glob = text.to_dict()
        head_dim, kv_heads = glob["head_dim"], glob.get("num_key_value_heads") or heads
        moe = bool(text.enable_moe_block)
        extra = dict(per_layer=_gemma4_layers(text), ple_dim=text.hidden_size_per_layer_input or 0,
                     ple_vocab=text.vocab_size_per_layer_input or 0,
                     experts=(text.num_experts or 0) if moe else 0, top_k=(text.top_k_experts or 0) if moe else 0,
                     moe_intermediate=(text.moe_intermediate_size or 0) if moe else 0)
    else:
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return Dims(
        family=family,
        model_type=mt,
        vocab=text.vocab_size,
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        layers=text.num_hidden_layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        tied=bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", True))),
        qkv_bias=mt == "qwen2" or bool(getattr(text, "attention_bias", False)),
        sliding_window=getattr(text, "sliding_window", None),
        layer_types=tuple(getattr(text, "layer_types", None) or ()),
        final_softcap=getattr(text, "final_logit_softcapping", None),
        **extra,
    )
