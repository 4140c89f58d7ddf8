"""Activation (gradient) checkpointing for transformers decoders: off, full, or every k-th layer.

Selective checkpointing keeps the activations of the layers it skips, trading memory back for
speed. With L layers and checkpoints every k-th layer the saved activations scale like
L/k (checkpoint inputs) + k (one segment recomputed at a time), minimised near k = sqrt(L) —
hence `auto`. Non-reentrant checkpointing (`use_reentrant=False`) is used: it works with frozen
parameters (LoRA) and with ZeRO-3's parameter hooks, where the reentrant form breaks.
"""

from __future__ import annotations

import math

from ..scale.spec import parse_checkpointing


def resolve(mode: str, num_layers: int) -> str:
    """'auto' -> 'every:K' with K = round(sqrt(L)); other values validated and returned canonical."""
    if mode == "auto":
        return f"every:{max(1, round(math.sqrt(num_layers)))}"
    kind, k = parse_checkpointing(mode)
    if kind == "every" and k == 1:
        return "full"
    return mode


def checkpointed_layers(mode: str, num_layers: int) -> list[int]:
    kind, k = parse_checkpointing(resolve(mode, num_layers))
    if kind == "off":
        return []
    return list(range(0, num_layers, k))  # layers 0, k, 2k, ... (as hfscale plan counts them)


def apply_checkpointing_(model, mode: str) -> list[int]:
    """Turn checkpointing on the model's decoder layers per `mode`; returns the checkpointed layer indices."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    chosen = checkpointed_layers(mode, len(layers))
    if not chosen:
        if getattr(model, "is_activation_checkpointing", False):
            model.activation_checkpointing_disable()
        return []
    kind, k = parse_checkpointing(resolve(mode, len(layers)))
    model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=k)
    model.config.use_cache = False
    actual = [i for i, m in enumerate(layers) if m.gradient_checkpointing]
    if actual != chosen:  # transformers counts layers itself; make a disagreement loud
        raise RuntimeError(f"checkpointing landed on layers {actual}, expected {chosen}")
    return actual
