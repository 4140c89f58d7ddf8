"""Routing statistics of an MoE model measured on the built-in corpus, its experts streamed under a RAM budget:
what `hfscale plan --inference --routing-blocks N` lays its expert-cache model over (hfscale.plan.moe_serving)."""

from __future__ import annotations


def calibration_routing(model: str, blocks: int, ram_budget: int | None = None):
    """`moe_serving.Routing` counted on `blocks` calibration blocks of 128 tokens with the model's own weights (a
    local directory); the experts are streamed by hfscale.experts under `ram_budget` (default: a quarter of them)."""
    from ..compress.evaluate import calibration_blocks
    from ..util.errors import HfscaleError
    from ..models.builtin import load_config, load_tokenizer
    from ..models.dims import dims_from_config
    from ..plan.moe_serving import measure_routing
    from .offload import from_pretrained

    d = dims_from_config(load_config(model))
    if not any(ld.moe for ld in d.per_layer):
        raise HfscaleError(f"--routing-blocks is for mixture-of-experts models and {model} has none; drop --routing-blocks")
    tok = load_tokenizer(model)
    expert = 3 * d.hidden * d.moe_intermediate * 4
    streamed = expert * d.experts * sum(1 for ld in d.per_layer if ld.moe)
    streaming = from_pretrained(model, ram_budget=ram_budget or max(streamed // 4, 4 * d.top_k * expert))
    try:
        return measure_routing(streaming, calibration_blocks(tok, n=blocks, seq_len=128))
    finally:
        streaming.hfscale_experts.close()
