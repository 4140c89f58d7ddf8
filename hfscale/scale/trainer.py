"""A ScaleSpec as `transformers.TrainingArguments` keywords: a pure mapping (no host, no environment), the third
serialisation beside `to_deepspeed` and `to_accelerate`. What the host running the Trainer adds (CPU, gloo) is
`hfscale.scale.runtime.training_arguments_kwargs`."""

from __future__ import annotations

from .checkpointing import every_n_layers
from .deepspeed import to_deepspeed
from .spec import ScaleSpec


def to_training_arguments(spec: ScaleSpec, deepspeed: str | None = None) -> dict:
    """Keywords that agree with the spec's DeepSpeed JSON: precision, clipping, checkpointing (every:K kept), the
    accumulation, and the DeepSpeed config (`deepspeed`: a path to it; default the JSON as a dict)."""
    every = every_n_layers(spec.gradient_checkpointing)
    kw: dict = {
        "bf16": spec.precision == "bf16",
        "fp16": spec.precision == "fp16",
        "max_grad_norm": float(spec.gradient_clipping),
        "gradient_checkpointing": every is not None,
    }
    if every is not None:
        # non-reentrant checkpointing works with frozen parameters and ZeRO-3 (transformers #47254);
        # Trainer hands every_n_layers to activation_checkpointing_enable, so every:K stays every:K
        kw["gradient_checkpointing_kwargs"] = {"use_reentrant": False, "every_n_layers": every}
    if spec.gradient_accumulation_steps != "auto":
        kw["gradient_accumulation_steps"] = spec.gradient_accumulation_steps
    if spec.uses_deepspeed:
        kw["deepspeed"] = deepspeed if deepspeed is not None else to_deepspeed(spec)
    return kw


__all__ = ["to_training_arguments"]
