"""Activation (gradient) checkpointing, the one home: parsing `off | full | every:K | auto`, which layers
a mode checkpoints, and turning it on in a transformers model. The config builders (scale/), the
planner (plan/) and the recipes (train/) all ask this module, so a strategy that is costed is the
strategy that runs.

Selective checkpointing keeps the activations of the layers it skips, trading memory back for
speed. With L layers and checkpoints every k-th layer the saved activations scale like
L/k (checkpoint inputs) + k (one segment recomputed at a time), minimised near k = sqrt(L) —
hence `auto`. Non-reentrant checkpointing (`use_reentrant=False`) is used: it works with frozen
parameters (LoRA) and with ZeRO-3's parameter hooks, where the reentrant form breaks.
"""

from __future__ import annotations

import math

from ..util.errors import ConfigError


def parse_checkpointing(value: str) -> tuple[str, int]:
    """'off' | 'full' | 'every:K' -> (mode, K). K=1 is the same as full."""
    if value in ("off", "full"):
        return value, 1
    if isinstance(value, str) and value.startswith("every:"):
        k = value.split(":", 1)[1]
        if k.isdigit() and int(k) >= 1:
            return "every", int(k)
    raise ConfigError(f"gradient checkpointing {value!r} not understood; use off, full or every:K (K >= 1)")


def every_n_layers(mode: str) -> int | None:
    """transformers' `every_n_layers` for a mode (1 = every layer), None when checkpointing is off."""
    kind, k = parse_checkpointing(mode)
    return None if kind == "off" else k


def resolve(mode: str, num_layers: int, period: int = 1) -> str:
    """'auto' -> 'every:K' with K = round(sqrt(L)), or with layers that repeat in a pattern of `period` (Gemma 3: 5
    sliding + 1 global) the nearest multiple of the period, so every checkpointed block holds the same mix of layer
    kinds (and the planner's trace scales in depth); other values validated and returned canonical."""
    if mode == "auto":
        k = max(1, round(math.sqrt(num_layers)))
        if period > 1 and period < num_layers:
            k = max(1, round(k / period)) * period
        mode = f"every:{k}"
    kind, k = parse_checkpointing(mode)
    if kind == "every" and k == 1:
        return "full"
    return mode


def checkpointed_layers(mode: str, num_layers: int) -> list[int]:
    """Indices of the checkpointed decoder layers: 0, k, 2k, ... (transformers' every_n_layers picks the same)."""
    kind, k = parse_checkpointing(resolve(mode, num_layers))
    if kind == "off":
        return []
    return list(range(0, num_layers, k))


def apply_checkpointing_(model, mode: str, launch_checkpoints_all: bool = False) -> list[int]:
    """Turn checkpointing on the model's decoder layers per `mode`; returns the checkpointed layer indices.
    `launch_checkpoints_all`: the launch's FSDP2 config asks accelerate to checkpoint (refused, see `with_launch`)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    with_launch(resolve(mode, len(layers)), launch_checkpoints_all)
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


def with_launch(mode: str, launch_checkpoints_all: bool) -> str:
    """The mode a run applies itself when its launch config may checkpoint too. FSDP2's
    `fsdp_activation_checkpointing: true` makes accelerate wrap every decoder layer in torch's checkpoint_wrapper at
    `prepare`; with transformers 5.24 and accelerate 1.16 that fails in the first forward on Gemma 3 (measured, 2 CPU
    ranks: "The size of tensor a (128) must match the size of tensor b (64) at non-singleton dimension 3" in eager
    attention), so such a launch is refused in one line and checkpointing is left to transformers (every layer or
    every K-th, measured under FSDP2 in tests/test_engine.py). Returns `mode` otherwise."""
    if not launch_checkpoints_all:
        return mode
    raise ConfigError("the accelerate config sets fsdp_activation_checkpointing: true, whose checkpoint_wrapper fails on "
                      "transformers' decoder layers (measured with Gemma 3); set it to false and checkpoint with "
                      f"transformers instead (--checkpointing {mode if mode != 'off' else 'full'}; hfscale config fsdp2 writes it so)")
