"""Tiny configs of transformers' causal LMs, one per architecture family (Gemma 3 is the built-in tiny model), for checking the
step trace against real runs (tests/test_trace.py, benchmarks/step_peak.py). Same small shape for all:
4 layers, hidden 128, 4 heads (2 KV heads where the family has GQA), MLP 256, vocabulary 2,048.
MoE families (mixtral, qwen3_moe) trace in fp32 too: torch 2.13's fake kernel of `aten._grouped_mm` (transformers'
default experts implementation) refuses fp32, which the real CPU kernel runs; the trace gives such calls their output
shape (trace._cpu_grouped_mm)."""

from __future__ import annotations

SHAPE = dict(vocab_size=2048, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256,
             max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
GQA = dict(num_key_value_heads=2)


def _make(cls_name: str, **extra):
    def build():
        import transformers

        cls = getattr(transformers, cls_name)
        return cls(**{**SHAPE, **extra})

    return build


def _gemma3():
    from ..models.builtin import tiny_config

    return tiny_config()


def _gemma4():
    """Gemma 4 text with per-layer inputs, KV sharing and a sliding window (32) shorter than the traced sequences."""
    import transformers

    return transformers.Gemma4TextConfig(**{**SHAPE, **GQA}, head_dim=32, global_head_dim=64, sliding_window=32,
                                         layer_types=["sliding_attention", "full_attention"] * 2,
                                         hidden_size_per_layer_input=8, vocab_size_per_layer_input=2048,
                                         num_kv_shared_layers=2, final_logit_softcapping=30.0)


ARCHITECTURES = {
    "gemma3": _gemma3,
    "gemma4": _gemma4,
    "llama": _make("LlamaConfig", **GQA),
    "qwen3": _make("Qwen3Config", **GQA, head_dim=32),
    "mistral": _make("MistralConfig", **GQA, sliding_window=64),
    "mixtral": _make("MixtralConfig", **GQA, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": _make("Qwen3MoeConfig", **GQA, head_dim=32, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=64, decoder_sparse_step=1),
    "gpt_neox": _make("GPTNeoXConfig"),
    "falcon": _make("FalconConfig", num_kv_heads=2, new_decoder_architecture=True, ffn_hidden_size=256),
    "starcoder2": _make("Starcoder2Config", **GQA, sliding_window=64),
    "granite": _make("GraniteConfig", **GQA),
    "phi3": _make("Phi3Config", **GQA),
    "olmo2": _make("Olmo2Config", **GQA),
}

__all__ = ["ARCHITECTURES", "SHAPE"]
