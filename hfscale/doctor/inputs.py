"""Reading doctor's inputs. A file that cannot be read or parsed is a HfscaleError (exit 2);
everything that parses is handed to the checks as plain data, however wrong it is."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


from ..util.errors import HfscaleError, first_line

from ..scale.load import find_deepspeed_file, read_mapping  # the one reader of config files and their references


@dataclass
class Setup:
    """Everything doctor looks at, already read."""

    accelerate: dict | None = None
    accelerate_file: str = "accelerate.yaml"
    deepspeed: dict | None = None
    deepspeed_file: str = "deepspeed.json"
    args: dict | None = None
    args_file: str = "args.yaml"
    model_config: object | None = None
    model_name: str | None = None
    num_processes: int | None = None
    num_machines: int | None = None
    gpus_per_machine: int | None = None
    # host facts, given by the caller (the CLI / the recipe read them): bf16 support, and whether the
    # launch runs on this host's CPU
    host_bf16: object | None = None  # hfscale.util.hosts.Bf16Support
    cpu_launch: bool = False
    planned_adamw: str = "fused"  # the AdamW implementation the plan assumed (hfscale plan --adamw)
    notes: list = field(default_factory=list)


def _read(source, kind: str, label: str | None) -> tuple[dict, str]:
    """A file path, or already-read data (a mapping) named by `label` in findings."""
    if isinstance(source, Mapping):
        return dict(source), label or kind
    return read_mapping(source, kind), label or str(source)


def load_setup(accelerate=None, deepspeed=None, args=None, model=None, num_processes=None, num_machines=None,
               gpus_per_machine=None, labels: dict | None = None, host_bf16=None, cpu_launch: bool = False,
               planned_adamw: str = "fused") -> Setup:
    """Each of accelerate / deepspeed / args is a path or a mapping (then `labels[name]` says where it came from)."""
    labels = labels or {}
    s = Setup(num_processes=num_processes, num_machines=num_machines, gpus_per_machine=gpus_per_machine,
              host_bf16=host_bf16, cpu_launch=cpu_launch, planned_adamw=planned_adamw)
    if accelerate:
        s.accelerate, s.accelerate_file = _read(accelerate, "accelerate config", labels.get("accelerate"))
    if args:
        s.args, s.args_file = _read(args, "training arguments", labels.get("args"))
    if deepspeed:
        s.deepspeed, s.deepspeed_file = _read(deepspeed, "DeepSpeed config", labels.get("deepspeed"))
    else:  # follow the reference in the accelerate YAML or in the arguments
        ref, beside = None, None
        if s.accelerate and isinstance(s.accelerate.get("deepspeed_config"), dict):
            ref, beside = s.accelerate["deepspeed_config"].get("deepspeed_config_file"), Path(accelerate).parent
        if not ref and s.args and isinstance(s.args.get("deepspeed"), str):
            ref, beside = s.args["deepspeed"], Path(args).parent
        if isinstance(ref, str) and ref not in ("", "none"):
            found = find_deepspeed_file(ref, beside)
            if found is None:
                s.notes.append(("missing-deepspeed-file", ref))
            else:
                s.deepspeed, s.deepspeed_file = read_mapping(found, "DeepSpeed config"), str(found)
    if model:
        from ..models.builtin import load_config

        path = Path(model)
        if path.is_file():  # a config.json
            from transformers import AutoConfig

            try:
                s.model_config = AutoConfig.from_pretrained(str(path.parent) if path.name == "config.json" else str(path))
            except (OSError, ValueError) as e:
                raise HfscaleError(f"cannot read model config {model}: {first_line(e, 200)}") from None
        else:
            s.model_config = load_config(model)
        s.model_name = str(model)
    return s
