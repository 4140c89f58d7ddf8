"""`hfscale doctor`: static pre-flight checks across accelerate YAML, DeepSpeed JSON, training
arguments, the model and the launch shape, in one pass, before a job burns cluster time.

    from hfscale.doctor import check
    findings = check(accelerate="accelerate_configs/zero3.yaml", args="recipe.yaml", model="gemma-3-4b")
"""

from __future__ import annotations

from .checks import CHECKS
from . import parallel as _parallel  # noqa: F401,E402  (registers the N-D parallelism checks)
from . import fsdp as _fsdp  # noqa: F401,E402  (registers the FSDP2 checks)
from . import optimizer as _optimizer  # noqa: F401,E402  (registers the AdamW-as-planned check)
from . import adapters as _adapters  # noqa: F401,E402  (registers the LoRA / DoRA / QLoRA traps)
from .findings import Finding, render_table
from .inputs import Setup, load_setup

__all__ = ["Finding", "check", "check_setup", "render_table"]


def check_setup(setup: Setup) -> list[Finding]:
    findings: list[Finding] = []
    for fn in CHECKS:
        findings.extend(fn(setup))
    return sorted(findings, key=lambda f: (f.severity != "error", f.where))


def check(accelerate=None, deepspeed=None, args=None, model=None, num_processes=None, num_machines=None,
          gpus_per_machine=None, labels=None, host_bf16=None, cpu_launch=False, planned_adamw="fused") -> list[Finding]:
    """Read the given files (HfscaleError if one cannot be read) and return every finding.

    accelerate / deepspeed / args may also be mappings already read, named in findings by `labels`
    (e.g. the training recipe passes what its launch will really use, `labels={"args": "train.yaml"}`).
    `host_bf16` (hfscale.util.hosts.Bf16Support) with `cpu_launch=True` adds the emulated-bf16 warning.
    `planned_adamw`: the AdamW implementation the plan assumed (`hfscale plan --adamw`)."""
    return check_setup(load_setup(accelerate, deepspeed, args, model, num_processes, num_machines, gpus_per_machine,
                                  labels, host_bf16, cpu_launch, planned_adamw))
