"""Doctor's FSDP2 checks: the traps users report with accelerate's FSDP2, caught from the YAML, the training
arguments and the model before a job starts.

  - accelerate before 1.13 casts the whole model to fp32 under FSDP2 mixed precision, frozen LoRA base included
    (accelerate #3844; fixed by #3848 in 1.13: only trainable parameters are upcast);
  - accelerate before 1.13 saves a SHARDED_STATE_DICT optimizer that its own load_state cannot read back
    ("Missing key in checkpoint state_dict: optimizer.state.0.step", accelerate #3971; fixed by #3904 in 1.13).
    With 1.16 here a 2-rank run killed and resumed reproduces its losses bit for bit (tests/test_recipe.py);
  - mixed precision set twice: a model loaded in bf16 under `mixed_precision: bf16` is upcast to fp32 masters
    by accelerate's fsdp2_prepare_model (the MixedPrecisionPolicy computes in bf16): 4 bytes per trainable
    parameter where the user planned 2;
  - the wrap class: `fsdp_transformer_layer_cls_to_wrap` naming no class of the model fails only at prepare;
  - accelerate's own checkpointing: `fsdp_activation_checkpointing: true` wraps every layer in torch's
    checkpoint_wrapper, which fails on transformers 5's decoder layers (measured with Gemma 3).
The installed accelerate's version is read once (`accelerate_version`), the one environment fact here.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterator

from .checks import MISSING, _acc, _args, _uses_adapters, check, get
from .findings import Finding
from .inputs import Setup

FIXED_IN = (1, 13)  # accelerate #3848 (LoRA upcast) and #3904 (sharded optimizer load) are both first in v1.13.0


@lru_cache(maxsize=1)
def accelerate_version() -> tuple[int, int]:
    from importlib.metadata import version

    major, minor = (version("accelerate").split(".") + ["0", "0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _fsdp2(s: Setup) -> bool:
    acc = s.accelerate or {}
    return get(acc, "distributed_type") == "FSDP" and get(acc, "fsdp_config.fsdp_version") in (2, "2")


def _model_dtype(args: dict) -> str | None:
    for key in ("torch_dtype", "dtype"):
        v = get(args, key)
        if isinstance(v, str):
            return v.replace("torch.", "")
    return None


@check
def fsdp2_version_traps(s: Setup) -> Iterator[Finding]:
    if not _fsdp2(s) or accelerate_version() >= FIXED_IN:
        return
    have = ".".join(map(str, accelerate_version()))
    acc = s.accelerate or {}
    if get(acc, "fsdp_config.fsdp_state_dict_type") in ("SHARDED_STATE_DICT", MISSING):  # accelerate's default
        yield Finding("fsdp2-sharded-optimizer-resume", "error", _acc(s, "fsdp_config.fsdp_state_dict_type"),
                      f"accelerate {have} saves FSDP2 SHARDED_STATE_DICT optimizer states it cannot load back "
                      "(\"Missing key ... optimizer.state.0.step\", accelerate #3971)",
                      "upgrade accelerate to >= 1.13, or set fsdp_state_dict_type: FULL_STATE_DICT")
    if _uses_adapters(s) and get(acc, "mixed_precision") in ("bf16", "fp16"):
        yield Finding("fsdp2-lora-upcast", "warning", _acc(s, "mixed_precision"),
                      f"accelerate {have} casts the whole model to fp32 under FSDP2 mixed precision, the frozen LoRA base "
                      "included (accelerate #3844): 4 bytes per base parameter instead of 2",
                      "upgrade accelerate to >= 1.13 (only trainable parameters are upcast there)")


@check
def fsdp2_precision_twice(s: Setup) -> Iterator[Finding]:
    if not _fsdp2(s) or s.args is None:
        return
    mp, dtype = get(s.accelerate or {}, "mixed_precision"), _model_dtype(s.args)
    if mp in ("bf16", "fp16") and dtype in ("bfloat16", "float16", "bf16", "fp16"):
        yield Finding("fsdp2-precision-twice", "warning", _args(s, "torch_dtype" if get(s.args, "torch_dtype") is not MISSING else "dtype"),
                      f"the model is loaded in {dtype} and mixed_precision is {mp}: accelerate's FSDP2 upcasts every "
                      "trainable parameter to fp32 (its MixedPrecisionPolicy computes in low precision), so the sharded "
                      "masters take 4 bytes per parameter, not 2",
                      "set precision once: load in fp32 with mixed_precision: bf16 (planned as such), or mixed_precision: "
                      "no for pure low-precision training")


@check
def fsdp2_accelerate_checkpointing(s: Setup) -> Iterator[Finding]:
    if _fsdp2(s) and get(s.accelerate, "fsdp_config.fsdp_activation_checkpointing") is True:
        yield Finding("fsdp2-accelerate-checkpointing", "error", _acc(s, "fsdp_config.fsdp_activation_checkpointing"),
                      "accelerate's checkpoint_wrapper fails on transformers' decoder layers (measured with Gemma 3: "
                      "\"The size of tensor a (128) must match the size of tensor b (64)\" in the first forward)",
                      "set it to false and checkpoint with transformers (gradient_checkpointing: true, every_n_layers as "
                      "needed; hfscale config fsdp2 --checkpointing full|every:K writes it so)")


@check
def fsdp2_wrap_class(s: Setup) -> Iterator[Finding]:
    name = get(s.accelerate or {}, "fsdp_config.fsdp_transformer_layer_cls_to_wrap")
    if not _fsdp2(s) or not isinstance(name, str) or s.model_config is None:
        return
    found = _layer_classes(type(s.model_config).__name__, getattr(s.model_config, "model_type", None))
    if found is None:
        return
    module_classes, default = found
    missing = [n.strip() for n in name.split(",") if n.strip() and n.strip() not in module_classes]
    if missing:
        yield Finding("fsdp2-wrap-class", "error", _acc(s, "fsdp_config.fsdp_transformer_layer_cls_to_wrap"),
                      f"{', '.join(missing)} is not a module class of {s.model_name or s.model_config.model_type} "
                      "(accelerate fails only at prepare: \"Could not find the transformer layer class\")",
                      f"use {default} or delete the key (accelerate then wraps the model's _no_split_modules)")


def _layer_classes(config_class: str, model_type: str | None):
    """(names of the nn.Module classes in the model's transformers modeling module, its _no_split_modules) or None."""
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    mapping = AutoModelForCausalLM._model_mapping
    cls = next((m for c, m in mapping.items() if c.__name__ == config_class), None)
    if cls is None:
        return None
    module = sys.modules.get(cls.__module__)
    names = {n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, torch.nn.Module)} if module else set()
    return names, ", ".join(getattr(cls, "_no_split_modules", None) or ["the decoder layer class"])
