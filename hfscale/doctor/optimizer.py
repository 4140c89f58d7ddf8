"""Doctor's optimizer check: the AdamW a launch will run against the one its plan assumed.

torch AdamW's implementations keep different temporaries in the optimizer step (hfscale.scale.optim), so where
that step is the peak a plan made for one is below what another reaches (foreach holds an extra copy of the
states it updates). What runs is read from, in order: the DeepSpeed JSON's `optimizer` block (DeepSpeed builds
its own), the training arguments' `optim` (Trainer; unset is adamw_torch_fused), a recipe YAML's `adamw`.
The plan's assumption is `Setup.planned_adamw` (`hfscale doctor --adamw`, default fused as `hfscale plan`'s).
Run on CPU: tests/test_doctor.py.
"""

from __future__ import annotations

from typing import Iterator

from ..scale.optim import ADAMW, as_planned, deepspeed_adamw, trainer_adamw, trainer_optim
from .checks import _args, _ds, check
from .findings import Finding
from .inputs import Setup

RECIPE_KEYS = ("global_batch_tokens", "max_steps", "seq_len")  # a recipe YAML (TrainConfig), not TrainingArguments


def runs(s: Setup) -> tuple[str, str] | None:
    """(what runs, where that is said), or None where nothing read says (a script's own loop)."""
    cuda = not s.cpu_launch
    ds = s.deepspeed if isinstance(s.deepspeed, dict) else {}
    if isinstance(ds.get("optimizer"), dict):
        return deepspeed_adamw(ds, cuda), _ds(s, "optimizer")
    args = s.args if isinstance(s.args, dict) else None
    if args is None:
        return None
    if "adamw" in args or any(k in args for k in RECIPE_KEYS):
        return str(args.get("adamw", "fused")), _args(s, "adamw")
    return trainer_adamw(args.get("optim"), cuda), _args(s, "optim")


@check
def adamw_planned(s: Setup) -> Iterator[Finding]:
    planned = s.planned_adamw
    if planned not in ADAMW:
        return
    found = runs(s)
    if found is None:
        return
    ran, where = found
    if as_planned(ran) == planned and (ran in ADAMW or ran in ("DeepSpeedCPUAdam", "FusedAdam")):
        return
    key = where.rsplit(":", 1)[-1]
    replan = f"plan with hfscale plan --adamw {ran}" if ran in ADAMW else "hfscale plan traces torch's AdamW only"
    fix = {"optim": f"set optim: {trainer_optim(planned) or 'adamw_torch'}, or {replan}",
           "adamw": f"set adamw: {planned}, or {replan}",
           "optimizer": f"plan with hfscale plan --adamw {as_planned(ran)}"}[key]
    yield Finding("adamw-not-planned", "warning", where,
                  f"runs {ran} but the plan assumed AdamW {planned}: their optimizer-step temporaries differ", fix)
