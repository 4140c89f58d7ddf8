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

from .errors import ConfigError


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


def resolve(mode: str, num_layers: int) -> str:
    """'auto' -> 'every:K' with K = round(sqrt(L)); other values validated and returned canonical."""
    if mode == "auto":
        mode = f"every:{max(1, round(math.sqrt(num_layers)))}"
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
    `launch_checkpoints_all`: the launch's FSDP2 config checkpoints every layer at `prepare` (see `with_launch`):
    nothing is applied here and all layers are returned."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if with_launch(resolve(mode, len(layers)), launch_checkpoints_all) != resolve(mode, len(layers)):
        return list(range(len(layers)))  # accelerate's checkpoint_wrapper on each layer, at prepare
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
    `fsdp_activation_checkpointing: true` makes accelerate wrap every decoder layer at `prepare`; applying
    transformers' checkpointing as well would checkpoint twice, and any other mode would be silently overridden.
    Returns "off" (accelerate does it) for full, refuses the rest in one line."""
    if not launch_checkpoints_all:
        return mode
    if mode == "full":
        return "off"
    raise ConfigError(f"the accelerate config checkpoints every layer (fsdp_activation_checkpointing: true) but checkpointing "
                      f"is {mode}; use --checkpointing full, or write the config with --checkpointing {mode} "
                      "(hfscale config fsdp2 --checkpointing ...) so the training code applies it")
