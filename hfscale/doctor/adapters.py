"""Doctor's adapter checks: the LoRA / DoRA / QLoRA traps that fail (or quietly degrade) a run, before it starts.

What an adapter run is, is read from either of the two forms configs carry:
  the recipe's `adapter:` section (hfscale.train.adapters.AdapterSpec's fields: kind, rank, targets, ...), or
  TRL's flat ModelConfig keys beside TrainingArguments (use_peft, lora_r, lora_target_modules,
  lora_modules_to_save, use_dora, load_in_4bit) and peft's own names (modules_to_save, target_modules).
The traps (issue 37; ../shared/ANCHORS.md "Adapters"):
  adapter-reentrant-frozen   reentrant checkpointing over a frozen base: "element 0 of tensors does not require
                             grad" unless the inputs are made to require grad (transformers #26221); ZeRO-3's own
                             variant is checks.py's zero3-checkpointing-reentrant
  adapter-merge-4bit         merging into a 4-bit base rounds the merged weights to NF4 (transformers #31293)
  adapter-tied-modules-to-save  modules_to_save on a tied embedding / lm_head unties them (peft #1750)
  adapter-gemma4-clippable   Gemma 4's vision / audio towers hold Gemma4ClippableLinear (not an nn.Linear) under
                             the decoder's names (q_proj, gate_proj, ...): peft rejects them (peft #3129)
  qlora-fsdp2-storage        a 4-bit base under FSDP2 stored as uint8 trains to loss 0 / NaN (accelerate #3983)
  adapter-engine-refused     the recipe's `adapter: qlora` under FSDP2, which recipes/train_clm.py refuses
                             (hfscale.scale.adapters.engine_refusal: the table the recipe raises from)
Run on CPU: tests/test_doctor.py (each with a failing and a passing input).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

from .checks import MISSING, _args, check, get, zero_stage
from .findings import Finding
from .inputs import Setup

ADAPTER_KINDS = ("none", "lora", "dora", "qlora")


@dataclass(frozen=True)
class AdapterView:
    """What the configs say about adapters: kind (lora / dora / qlora), the target names given (None: the
    default), the modules saved in full, whether the adapter is merged at the end, where each was said."""

    kind: str
    targets: tuple | str | None
    modules_to_save: tuple
    merge: bool
    where: str  # the key that said it


def adapter_view(s: Setup) -> AdapterView | None:
    """The adapter run the args describe, or None (full fine-tuning). Never raises on odd input."""
    a = s.args if isinstance(s.args, dict) else {}
    sec = a.get("adapter")
    if isinstance(sec, str):  # `adapter: lora` (the CLI's --adapter written as a key)
        sec = {"kind": sec}
    if isinstance(sec, dict):
        kind = sec.get("kind", "lora")
        if kind not in ADAPTER_KINDS[1:]:
            return None
        # the section's targets are leaf names hfscale.scale.adapters resolves to exact decoder modules (a clippable
        # linear through its .linear): never handed to peft as names, so not checked as such (None)
        return AdapterView(kind, None, _names(sec.get("modules_to_save")) or (), sec.get("merge") is True,
                           _args(s, "adapter"))
    peft = any(get(a, k) not in (MISSING, None, False, 0) for k in ("use_peft", "lora_r", "peft", "lora", "qlora"))
    four = get(a, "load_in_4bit") is True or get(a, "qlora") is True
    if not (peft or four):
        return None
    kind = "qlora" if four else "dora" if get(a, "use_dora") is True else "lora"
    targets = next((_names(a[k]) for k in ("lora_target_modules", "target_modules") if a.get(k) is not None), None)
    save = next((_names(a[k]) for k in ("lora_modules_to_save", "modules_to_save") if a.get(k) is not None), None) or ()
    merge = any(a.get(k) is True for k in ("merge_adapter", "merge_and_unload"))
    return AdapterView(kind, targets, save, merge, _args(s, "use_peft" if "use_peft" in a else "lora_r"))


def _names(v):
    """A list of module names as a tuple; a string (a regex or "all-linear") kept; anything else None."""
    if isinstance(v, str):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
        return tuple(v)
    return None


@check
def reentrant_frozen(s: Setup) -> Iterator[Finding]:
    v, a = adapter_view(s), s.args if isinstance(s.args, dict) else {}
    if v is None or zero_stage(s) == 3 or get(a, "gradient_checkpointing") is not True:  # ZeRO-3: checks.py's
        return
    if get(a, "gradient_checkpointing_kwargs.use_reentrant") is True:
        yield Finding("adapter-reentrant-frozen", "warning", _args(s, "gradient_checkpointing_kwargs.use_reentrant"),
                      f"reentrant checkpointing over a frozen {v.kind} base: backward fails (\"element 0 of tensors does "
                      "not require grad\", transformers #26221) unless something makes the inputs require grad "
                      "(transformers' gradient_checkpointing_enable does; other checkpointing code does not)",
                      "set gradient_checkpointing_kwargs: {use_reentrant: false} (what hfscale's recipes run)")


@check
def merge_4bit(s: Setup) -> Iterator[Finding]:
    v = adapter_view(s)
    if v is not None and v.kind == "qlora" and v.merge:
        yield Finding("adapter-merge-4bit", "error", v.where,
                      "merging the adapter into the 4-bit base rounds the merged weights to NF4 and degrades the model "
                      "(transformers #31293)",
                      "merge into the base reloaded in bf16, then quantize (hfscale's recipe writes OUTPUT_DIR/model so)")


def _tied(config) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))


@check
def tied_modules_to_save(s: Setup) -> Iterator[Finding]:
    v = adapter_view(s)
    if v is None or s.model_config is None or not _tied(s.model_config):
        return
    tied = [m for m in v.modules_to_save if m.split(".")[-1] in ("embed_tokens", "lm_head")]
    if tied:
        yield Finding("adapter-tied-modules-to-save", "error", v.where,
                      f"modules_to_save {', '.join(tied)} copies one of the tied embedding / lm_head and trains it apart: "
                      f"the two untie and the saved model grows by a vocab x hidden matrix (peft #1750)",
                      "train new tokens through trainable_token_indices (the adapter's trainable_tokens) or keep the tie "
                      "(peft ensure_weight_tying: true)")


def clippable_names() -> frozenset:
    """The attribute names Gemma 4's modeling code gives Gemma4ClippableLinear modules (read from its source, so a
    new release's names are the names checked)."""
    import inspect

    from transformers.models.gemma4 import modeling_gemma4

    src = inspect.getsource(modeling_gemma4)
    return frozenset(re.findall(r"self\.(\w+)\s*=\s*Gemma4ClippableLinear\(", src))


@check
def gemma4_clippable(s: Setup) -> Iterator[Finding]:
    v, c = adapter_view(s), s.model_config
    if v is None or getattr(c, "model_type", None) != "gemma4" or not isinstance(v.targets, (tuple, str)):
        return
    if not any(getattr(c, k, None) is not None for k in ("vision_config", "audio_config")):
        return
    names = (v.targets,) if isinstance(v.targets, str) else v.targets
    hit = sorted(set(names) & clippable_names())
    if hit and v.targets != "all-linear":
        yield Finding("adapter-gemma4-clippable", "error", v.where,
                      f"targets {', '.join(hit)} also name Gemma 4's vision / audio Gemma4ClippableLinear modules, which "
                      "are not nn.Linear: peft refuses the model (peft #3129)",
                      "leave targets unset (hfscale's default adapts the language model's decoder linears only) or "
                      "give a regex over the language model, e.g. '.*language_model.*\\.(q_proj|v_proj)'")


@check
def qlora_fsdp2_storage(s: Setup) -> Iterator[Finding]:
    from ..scale.adapters import nf4_storage
    from .fsdp import _fsdp2

    v, a = adapter_view(s), s.args if isinstance(s.args, dict) else {}
    if v is None or v.kind != "qlora" or not _fsdp2(s) or isinstance(a.get("adapter"), (dict, str)):
        return  # the recipe's section: hfscale's recipe refuses QLoRA under FSDP2 (adapter-engine-refused below)
    storage = get(a, "bnb_4bit_quant_storage")
    if storage in (MISSING, "uint8", "torch.uint8"):
        want = nf4_storage("fp16" if get(a, "fp16") is True else "bf16", None, fsdp=True)  # the one storage rule
        yield Finding("qlora-fsdp2-storage", "error", _args(s, "bnb_4bit_quant_storage"),
                      f"a 4-bit base under FSDP2 stored as {storage if storage is not MISSING else 'uint8 (the default)'} "
                      "trains to loss 0 / NaN (accelerate #3983): FSDP2 shards parameters of one dtype",
                      f"set bnb_4bit_quant_storage to the model's dtype ({want})")


@check
def adapter_engine_refused(s: Setup) -> Iterator[Finding]:
    """The recipe's own QLoRA (`adapter: qlora` / `adapter: {kind: qlora}`), its trainable_tokens or its embedding
    adapter, on an engine the recipe refuses it on: the same table (scale.adapters.engine_refusal) the recipe raises
    from, so doctor says it from the files before a launch. TRL's keys (a user's own Trainer) are left to qlora-zero3-storage / qlora-fsdp2-storage."""
    from ..scale.adapters import engine_refusal
    from .fsdp import _fsdp2

    v, a = adapter_view(s), s.args if isinstance(s.args, dict) else {}
    if v is None or not isinstance(a.get("adapter"), (dict, str)):
        return
    section = a["adapter"] if isinstance(a["adapter"], dict) else {}
    refused = engine_refusal(v.kind, zero_stage(s), _fsdp2(s), bool(section.get("trainable_tokens")),
                             section.get("embedding") is True)
    if refused is not None:
        yield Finding("adapter-engine-refused", "error", v.where, refused[0], refused[1])
