"""Writing a picked plan with the foundation's config builders: accelerate YAML, DeepSpeed JSON, the
TrainingArguments keywords (as YAML) that agree with them, and the same settings as a
recipes/train_clm.py config. The checkpointing the plan costed (off / full / every:K) is the one all
three ways of training run: Trainer gets every_n_layers, the recipe and plain loops
`hfscale.scale.checkpointing.apply_checkpointing_`. A planned adapter (LoRA / DoRA / QLoRA) is written as the recipe's
`adapter:` section and as TRL's peft / bitsandbytes keys in the training arguments (the 4-bit storage dtype the
engine needs), so the run trains what was planned."""

from __future__ import annotations

from pathlib import Path

import yaml

from ..util.atomic import check_writable, write_text_atomic
from ..scale.files import render_config_set
from ..scale.optim import DEFAULT_ADAMW, trainer_optim
from ..scale.trainer import to_training_arguments
from .adapters import recipe_section, trainer_keys
from .planner import to_scale_spec


def write_plan(row, hw, out: Path, force: bool = False, model: str | None = None, seq_len: int | None = None,
               adamw: str = DEFAULT_ADAMW) -> list[Path]:
    """`adamw`: the AdamW implementation planned, written as Trainer's `optim` and the recipe's `adamw`."""
    spec = to_scale_spec(row, hw)
    files = render_config_set(spec, out, out)
    kw = to_training_arguments(spec, deepspeed=str(out / f"{spec.name}.json"))  # for the cluster, not this host
    args = {"per_device_train_batch_size": row.micro_batch, "gradient_accumulation_steps": row.grad_accum, **kw}
    optim = trainer_optim(adamw)
    if optim:
        args["optim"] = optim
    adapter = row.strategy.adapter_spec  # the planned adapter: the recipe's section, TRL / peft / bnb keys for Trainer
    engine = "fsdp2" if row.strategy.engine == "fsdp2" else "zero3" if row.zero == 3 else "other"
    args.update(trainer_keys(adapter, engine, row.precision))
    header = (f"# TrainingArguments for the plan '{row.label}' (hfscale plan --write); predicted peak {row.peak_bytes / 1e9:.1f} GB/GPU"
              f" with AdamW {adamw}\n" + ("" if optim else "# Trainer cannot run the for-loop AdamW on GPUs (adamw_torch "
                                           "runs foreach there): use the recipe, or plan with --adamw foreach\n"))
    files[out / "training_args.yaml"] = header + yaml.safe_dump(args, sort_keys=False)
    if model and seq_len:
        recipe = {"model": model, "seq_len": seq_len, "micro_batch": row.micro_batch,
                  "global_batch_tokens": row.micro_batch * row.grad_accum * row.dp * seq_len,
                  "checkpointing": row.checkpointing, "precision": "launch", "adamw": adamw,
                  **row.prediction.extra.get("levers", {})}  # long context: tiled_loss / tiled_mlp / offload_activations / tiled_norm
        if adapter.enabled:  # read back by hfscale.scale.adapters.AdapterSpec.from_mapping
            recipe["adapter"] = recipe_section(adapter)
        files[out / "recipe.yaml"] = (
            f"# accelerate launch --config_file {out / (spec.name + '.yaml')} recipes/train_clm.py --config {out / 'recipe.yaml'}\n"
            f"# recipes/train_clm.py settings for the plan '{row.label}' (hfscale plan --write); add data, max_steps, lr\n"
            + yaml.safe_dump(recipe, sort_keys=False))
    check_writable({p: "--write" for p in files}, force)
    return [write_text_atomic(p, t) for p, t in files.items()]
