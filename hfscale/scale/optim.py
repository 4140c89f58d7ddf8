"""Which torch AdamW a run builds, and which one a plan assumes: the one home for that choice.

torch.optim.AdamW has three implementations, and they keep different temporaries in the optimizer step, so
where that step is the peak (full checkpointing, short sequences) the choice moves the peak:

  fused     one kernel per tensor list, updates in place (torch has it on CPU and CUDA); transformers
            Trainer's default (`optim="adamw_torch_fused"`). The recipes and `make_optimizer` build it, and
            `hfscale plan` assumes it unless told otherwise (`--adamw`).
  foreach   whole-list intermediates: the step holds an extra copy of the states it updates
            (torch's default on CUDA when no implementation is named).
  forloop   one parameter's intermediates at a time (torch's default on CPU when none is named).

Measured with MemTracker on CPU (fp32, full checkpointing, steady step; benchmarks/results/adamw_peak.md):
built-in tiny Gemma 3 at 1 x 32 tokens: fused 54,322,788 B = for-loop = plan, foreach +10.5%.

DeepSpeed's own optimizers (a JSON with an `optimizer` block: DeepSpeedCPUAdam under offload) step in place
like fused; `adamw_impl` names them by class and the plan models them as in place (plan/zero.py).
"""

from __future__ import annotations

from ..util.errors import ConfigError

# name -> the keywords torch.optim.AdamW takes for it (explicit both ways, so torch's own default never decides)
ADAMW_KWARGS = {"fused": {"fused": True}, "foreach": {"foreach": True, "fused": False},
                "forloop": {"foreach": False, "fused": False}}
ADAMW = tuple(ADAMW_KWARGS)
DEFAULT_ADAMW = "fused"  # what the recipes build and the plan assumes (transformers Trainer's default too)
# TrainingArguments.optim values that run torch's AdamW; "adamw_torch" names no implementation: torch decides
TRAINER_OPTIM = {"adamw_torch_fused": "fused", "adamw_torch": None}


def check_adamw(name: str) -> str:
    """`name` if it is one of ADAMW, else a ConfigError naming the choices."""
    if name not in ADAMW_KWARGS:
        raise ConfigError(f"adamw {name!r} is not an AdamW implementation; use one of {', '.join(ADAMW)}")
    return name


def build_adamw(params, adamw: str = DEFAULT_ADAMW, **hyper):
    """torch.optim.AdamW over `params` running the implementation named (`hyper`: lr, weight_decay, betas, eps)."""
    import torch

    return torch.optim.AdamW(params, **hyper, **ADAMW_KWARGS[check_adamw(adamw)])


def torch_default(cuda: bool) -> str:
    """What torch runs when no implementation is named (torch 2.13: foreach on CUDA, the for-loop on CPU)."""
    return "foreach" if cuda else "forloop"


def optimizer_chain(optimizer) -> list:
    """The optimizer and what it wraps (accelerate's wrapper -> DeepSpeed's ZeRO optimizer -> torch's)."""
    chain, obj = [], optimizer
    while obj is not None and obj not in chain:
        chain.append(obj)
        obj = getattr(obj, "optimizer", None)
    return chain


def adamw_impl(optimizer) -> str:
    """Which implementation the torch AdamW inside `optimizer` (or its accelerate / DeepSpeed wrappers) runs:
    fused / foreach / forloop, or the class name of a non-torch optimizer (DeepSpeedCPUAdam, FusedAdam)."""
    import torch

    base = optimizer_chain(optimizer)[-1]
    if not isinstance(base, torch.optim.Optimizer) or type(base).__module__.split(".")[0] != "torch":
        return type(base).__name__
    d = base.defaults
    if d.get("fused"):
        return "fused"
    if d.get("foreach") is None:
        return torch_default(any(p.is_cuda for g in base.param_groups for p in g["params"]))
    return "foreach" if d["foreach"] else "forloop"


def deepspeed_adamw(ds_config: dict, cuda: bool = True) -> str | None:
    """The optimizer DeepSpeed builds from its JSON's `optimizer` block (None: no block, the client's optimizer
    runs). DeepSpeed 0.19's engine: `torch_adam: true` -> torch's AdamW (its `foreach` or torch's default),
    optimizer offload -> DeepSpeedCPUAdam, else its FusedAdam (CUDA)."""
    block = ds_config.get("optimizer") if isinstance(ds_config, dict) else None
    if not isinstance(block, dict) or str(block.get("type", "")).lower() not in ("adam", "adamw"):
        return None if not isinstance(block, dict) else str(block.get("type"))
    params = block.get("params") if isinstance(block.get("params"), dict) else {}
    if params.get("torch_adam"):
        foreach = params.get("foreach")
        return torch_default(cuda) if foreach is None else "foreach" if foreach else "forloop"
    zero = ds_config.get("zero_optimization") if isinstance(ds_config.get("zero_optimization"), dict) else {}
    off = zero.get("offload_optimizer") if isinstance(zero.get("offload_optimizer"), dict) else {}
    return "DeepSpeedCPUAdam" if off.get("device") in ("cpu", "nvme") else "FusedAdam"


def as_planned(impl: str) -> str:
    """The traced implementation whose step temporaries `impl` has: DeepSpeed's own optimizers (CPU Adam,
    FusedAdam) update in place, as fused does."""
    return impl if impl in ADAMW_KWARGS else DEFAULT_ADAMW


def trainer_optim(adamw: str) -> str | None:
    """The TrainingArguments `optim` that runs `adamw` on GPUs (None: Trainer cannot name the for-loop there;
    its adamw_torch runs torch's default, foreach on CUDA)."""
    return {"fused": "adamw_torch_fused", "foreach": "adamw_torch"}.get(check_adamw(adamw))


def trainer_adamw(optim, cuda: bool = True) -> str | None:
    """The AdamW implementation a TrainingArguments `optim` runs (None: not given, so Trainer's default,
    adamw_torch_fused); another optimizer's name as given."""
    if optim is None:
        return DEFAULT_ADAMW
    key = str(optim).lower()
    if key not in TRAINER_OPTIM:
        return str(optim)
    return TRAINER_OPTIM[key] or torch_default(cuda)


__all__ = ["ADAMW", "ADAMW_KWARGS", "DEFAULT_ADAMW", "TRAINER_OPTIM", "adamw_impl", "as_planned", "build_adamw", "check_adamw", "deepspeed_adamw",
           "optimizer_chain", "torch_default", "trainer_adamw", "trainer_optim"]
