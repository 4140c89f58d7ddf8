"""Writing a picked plan with the foundation's config builders: accelerate YAML, DeepSpeed JSON and
the TrainingArguments keywords (as YAML) that agree with them."""

from __future__ import annotations

from pathlib import Path

import yaml

from ..atomic import check_writable, write_text_atomic
from ..scale.files import render_config_set
from ..scale.runtime import training_arguments_kwargs
from .planner import to_scale_spec


def write_plan(row: dict, hw, out: Path, force: bool = False) -> list[Path]:
    spec = to_scale_spec(row, hw)
    files = render_config_set(spec, out, out)
    kw = training_arguments_kwargs(spec)
    kw.pop("deepspeed", None)
    kw.pop("use_cpu", None)
    kw.pop("ddp_backend", None)
    args = {"per_device_train_batch_size": row["micro_batch"], "gradient_accumulation_steps": row["grad_accum"], **kw}
    if spec.uses_deepspeed:
        args["deepspeed"] = str(out / f"{spec.name}.json")
    header = f"# TrainingArguments for the plan '{row['strategy']}' (hfscale plan --write); predicted peak {row['peak_bytes'] / 1e9:.1f} GB/GPU\n"
    files[out / "training_args.yaml"] = header + yaml.safe_dump(args, sort_keys=False)
    check_writable({p: "--write" for p in files}, force)
    return [write_text_atomic(p, t) for p, t in files.items()]
