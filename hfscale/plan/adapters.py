"""Planning adapters: full fine-tuning, LoRA, DoRA and QLoRA side by side for one model and GPU, and the adapter
settings a written plan carries (the recipe's `adapter:` section; peft / bitsandbytes keys for Trainer / TRL).

The adapter is one hfscale.scale.adapters.AdapterSpec, the recipe's: the planner traces it through the same
`apply_adapter` (plan/trace.py), prices it with the same targets (plan/memory.py), and writes it back as the
recipe reads it, so a planned QLoRA run is a QLoRA run.

    from hfscale.plan.adapters import compare_adapters
    rows = compare_adapters("gemma-3-1b", seq_len=2048, micro_batch=1, rank=16)    # full / LoRA / DoRA / QLoRA

Run on CPU: tests/test_plan_adapters.py (tiny Gemma 3 and a small Gemma 4).
"""

from __future__ import annotations

from dataclasses import dataclass

COMPARED = ("none", "lora", "dora", "qlora")


@dataclass(frozen=True)
class AdapterRow:
    """One adapter's per-GPU prediction: `peak` is the traced step peak, or (QLoRA, untraceable on fake tensors) the
    analytic total, as `source` says; `base` the frozen (or trained, for full) weights' bytes per rank."""

    kind: str
    label: str
    peak: int
    source: str  # trace | analytic
    trainable_params: int
    params: int
    weights: int | None  # the analytic weights term (None where the model has no formulas)
    note: str | None = None

    def to_dict(self) -> dict:
        return {"kind": self.kind, "label": self.label, "peak": self.peak, "source": self.source,
                "trainable_params": self.trainable_params, "params": self.params, "weights": self.weights,
                "note": self.note}


def compare_adapters(model: str, seq_len: int, micro_batch: int, rank: int = 16, kinds=COMPARED,
                     **plan_kw) -> tuple[AdapterRow, ...]:
    """`hfscale plan --compare-adapters`: `plan(model, seq_len, micro_batch, adapter=kind, ...)` for each kind, the
    same strategy otherwise (zero, dp, engine, checkpointing, precision... in `plan_kw`; no hardware search)."""
    from ..util.errors import HfscaleError
    from .api import plan

    if plan_kw.get("hardware") is not None:
        raise HfscaleError("--compare-adapters compares one strategy; drop the hardware flags (--gpus-per-node ...)")
    rows = []
    for kind in kinds:
        r = plan(model, seq_len, micro_batch, adapter=kind, lora_rank=0 if kind == "none" else rank, **plan_kw)
        p = r.prediction
        rows.append(AdapterRow(kind, r.strategy.label, p.peak if p.source == "trace" else p.terms_total, p.source,
                               p.trainable_params, p.params, p.terms["weights"] if p.terms else None,
                               None if p.source == "trace" else p.not_traced))
    return tuple(rows)


def recipe_section(spec) -> dict | None:
    """The recipe YAML's `adapter:` section for a spec (None for full fine-tuning): the fields that differ from
    AdapterSpec's defaults, kind and rank always (what AdapterSpec.from_mapping reads back to the same spec)."""
    from dataclasses import fields

    from ..scale.adapters import AdapterSpec

    if not spec.enabled:
        return None
    default = AdapterSpec(spec.kind)
    out = {"kind": spec.kind, "rank": int(spec.rank)}
    for f in fields(spec):
        v = getattr(spec, f.name)
        if f.name not in out and v != getattr(default, f.name) and not (f.name == "alpha" and v == 2 * spec.rank):
            out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def quant_storage(engine: str, precision: str) -> str:
    """For a user's own Trainer (TRL keys): the dtype bitsandbytes stores a 4-bit base in on `engine` (zero3 | fsdp2 |
    other), by the one rule hfscale.scale.adapters.nf4_storage (the model's dtype where parameters are sharded as
    one dtype, uint8 elsewhere). hfscale's own recipe loads its base by the same rule (qlora_dtypes), and refuses
    QLoRA under FSDP2 (scale.adapters.QLORA_REFUSED, measured; doctor's adapter-engine-refused)."""
    from ..scale.adapters import nf4_storage

    return nf4_storage(precision, 3 if engine == "zero3" else None, engine == "fsdp2")


def trainer_keys(spec, engine: str, precision: str) -> dict:
    """The same adapter as TRL's ModelConfig keys (beside TrainingArguments; what `hfscale doctor` reads), with the
    bitsandbytes settings of a QLoRA base. {} for full fine-tuning."""
    if not spec.enabled:
        return {}
    out = {"use_peft": True, "lora_r": int(spec.rank), "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
           "lora_target_modules": list(spec.targets), "use_dora": spec.dora, "use_rslora": spec.rslora}
    if spec.base_bits == 4:
        out.update(load_in_4bit=True, bnb_4bit_quant_type="nf4", use_bnb_nested_quant=True,
                   bnb_4bit_quant_storage=quant_storage(engine, precision))
    return out


__all__ = ["AdapterRow", "COMPARED", "compare_adapters", "quant_storage", "recipe_section", "trainer_keys"]
