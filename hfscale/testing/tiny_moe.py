"""Tiny Gemma-4-MoE-shaped models: the shipped gemma-4-26b-a4b config with smaller dimensions and fewer
experts, and the same routing and block structure: a shared dense MLP beside the routed experts in every
layer, softmax router over all experts -> top-k -> renormalised to sum 1 -> per-expert scale, k=v
attention on full layers with their own KV head count and head size, proportional RoPE (25%) on full
layers, sliding layers between them, final logit softcapping, tied embeddings, the built-in tokenizer.

Used by the expert-offload tests, the GGUF MoE export test and benchmarks/experts.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from .trained import cached_dir, fit

S, F = "sliding_attention", "full_attention"


def tiny_moe_config(**overrides):
    """A Gemma4TextConfig from the 26B-A4B dimension file with small sizes; `overrides` win."""
    from transformers import Gemma4TextConfig

    from ..models.builtin import dimension_configs

    data = json.loads(dimension_configs()["gemma-4-26b-a4b"].read_text())
    data = {k: v for k, v in data.items() if k not in ("model_type", "architectures")}
    small = dict(vocab_size=4096, vocab_size_per_layer_input=4096, hidden_size=128, intermediate_size=256,
                 moe_intermediate_size=64, num_experts=16, top_k_experts=4, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1, head_dim=32,
                 global_head_dim=64, layer_types=[S, S, F] * 2, sliding_window=64, max_position_embeddings=2048)
    return Gemma4TextConfig(**{**data, **small, **overrides})


def build_tiny_moe(out, config=None, steps: int = 0, seed: int = 0, jitter: bool = True) -> str:
    """Seeded init, norm weights / layer scalars / per-expert scales moved away from 1 (`jitter`, so their
    conventions are exercised), `steps` of AdamW on the built-in corpus (peaked next-token distributions
    make top-1 agreement meaningful), saved with the built-in tokenizer as a transformers directory."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..data.corpus import load_text, packed_blocks
    from ..models.builtin import TINY, load_tokenizer

    cfg = config or tiny_moe_config()
    tok = load_tokenizer(TINY)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    if jitter:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("norm.weight", "per_expert_scale", "router.scale")):
                    p.mul_(1 + 0.2 * torch.randn(p.shape, generator=g))
            for name, b in model.named_buffers():
                if name.endswith("layer_scalar"):
                    b.fill_(0.5 + torch.rand(1, generator=g).item())
    if steps:
        blocks = packed_blocks(tok, load_text()["train"]["text"], 128)
        fit(model, lambda _: blocks[torch.randint(len(blocks), (8,), generator=g)], steps, 3e-3)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return str(Path(out))


def cached_tiny_moe(steps: int = 30, seed: int = 0, cache=None, **overrides) -> str:
    """`build_tiny_moe(tiny_moe_config(**overrides), steps, seed)`, built once under $HFSCALE_CACHE
    (keyed by the config and recipe) and reused: tests and benchmarks share one trained copy."""
    import hashlib

    cfg = tiny_moe_config(**overrides)
    key = hashlib.sha256(json.dumps([cfg.to_dict(), steps, seed], sort_keys=True, default=str).encode()).hexdigest()[:12]
    return str(cached_dir("tiny-gemma4-moe", key, lambda tmp: build_tiny_moe(tmp, cfg, steps=steps, seed=seed),
                          "config.json", cache))
