"""The dimensions of a decoder-only LM, read from its transformers config, and its exact parameter count."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import HfscaleError

# families whose decoder layer the activation model knows (HF eager implementations)
GEMMA = ("gemma3_text", "gemma3")  # Gemma 4 adds per-layer inputs, per-layer head dims, MoE: not modelled yet
LLAMA_LIKE = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class Dims:
    family: str  # "gemma" or "llama"
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
        norms = (4 if self.family == "gemma" else 2) * self.hidden
        return self.attn_params + self.mlp_params + norms

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        head = 0 if self.tied else self.vocab * self.hidden
        return self.embedding_params + self.layers * self.layer_params + self.hidden + head

    @property
    def largest_layer_params(self) -> int:
        """The largest single module ZeRO-3 must gather at once (the embedding, for Gemma's 262k vocab)."""
        return max(self.embedding_params, self.attn_params, self.mlp_params)


def dims_from_config(config) -> Dims:
    text = getattr(config, "text_config", None) or config
    mt = getattr(text, "model_type", "")
    if mt in GEMMA:
        family = "gemma"
    elif mt in LLAMA_LIKE:
        family = "llama"
    else:
        raise HfscaleError(f"no memory model for model_type {mt!r}; supported: {', '.join(GEMMA + LLAMA_LIKE)}")
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return Dims(
        family=family,
        model_type=mt,
        vocab=text.vocab_size,
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        layers=text.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        tied=bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", True))),
        qkv_bias=mt == "qwen2" or bool(getattr(text, "attention_bias", False)),
        sliding_window=getattr(text, "sliding_window", None),
        layer_types=tuple(getattr(text, "layer_types", None) or ()),
    )
