"""hfscale/scale/optim.py: the AdamW the recipes build is the one `hfscale plan` traces (issue 39), and the
detector that names it (`adamw_impl`, also what `hfscale profile` records) reads the implementation torch runs."""

import argparse
import inspect

import pytest
import torch

from hfscale.scale.optim import (ADAMW, DEFAULT_ADAMW, adamw_impl, as_planned, build_adamw, deepspeed_adamw,
                                 trainer_adamw, trainer_optim)
from hfscale.util.errors import ConfigError


def test_the_recipes_optimizer_is_the_one_the_plan_traces(fresh_accelerate):
    """Fails if make_optimizer (every recipe, the profile and engine workers) and the plan's default ever differ."""
    from accelerate import Accelerator

    from hfscale.cli import plan_cmd, profile_cmd
    from hfscale.models import build_model
    from hfscale.plan.api import plan
    from hfscale.plan.memory import Strategy
    from hfscale.plan.peak import step_prediction
    from hfscale.scale.runtime import make_optimizer
    from hfscale.train.config import TrainConfig

    acc = Accelerator(cpu=True)
    model = build_model("tiny-gemma3")
    built = make_optimizer(acc, model, lr=1e-3, weight_decay=0.0)  # as the recipes call it, with TrainConfig's default
    _, prepared = acc.prepare(model, built)
    ran = adamw_impl(prepared)  # through accelerate's wrapper, as the recipe's start line and the profiler read it
    planned = {"Strategy": Strategy().adamw, "plan()": inspect.signature(plan).parameters["adamw"].default,
               "step_prediction": inspect.signature(step_prediction).parameters["adamw"].default,
               "TrainConfig": TrainConfig().adamw,
               "make_optimizer": inspect.signature(make_optimizer).parameters["adamw"].default}
    for mod in (plan_cmd, profile_cmd):
        sub = argparse.ArgumentParser().add_subparsers()
        mod.add_parser(sub)
        (p,) = sub.choices.values()
        planned[mod.__name__] = p.get_default("adamw")
    assert ran == "fused" == DEFAULT_ADAMW and set(planned.values()) == {ran}, planned
    # torch named nothing before issue 39: the for-loop on this CPU, which the detector still tells apart
    assert adamw_impl(torch.optim.AdamW(model.parameters(), lr=1e-3)) == "forloop"


@pytest.mark.parametrize("impl", ADAMW)
def test_each_implementation_is_built_and_detected(impl):
    lin = torch.nn.Linear(8, 4)
    opt = build_adamw(lin.parameters(), impl, lr=1e-2)
    lin(torch.ones(2, 8)).sum().backward()
    before = lin.weight.detach().clone()
    opt.step()
    assert adamw_impl(opt) == impl and not torch.equal(before, lin.weight)  # it ran a step
    with pytest.raises(ConfigError, match="fused, foreach, forloop"):
        build_adamw(lin.parameters(), "8bit", lr=1e-2)


def test_what_trainer_and_deepspeed_run():
    assert trainer_adamw(None) == "fused"  # TrainingArguments' default with torch >= 2.8: adamw_torch_fused
    assert trainer_adamw("adamw_torch", cuda=True) == "foreach" and trainer_adamw("adamw_torch", cuda=False) == "forloop"
    assert trainer_adamw("adafactor") == "adafactor"
    assert [trainer_optim(a) for a in ADAMW] == ["adamw_torch_fused", "adamw_torch", None]
    offload = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    assert deepspeed_adamw(offload) == "DeepSpeedCPUAdam" and as_planned("DeepSpeedCPUAdam") == "fused"
    assert deepspeed_adamw({"optimizer": {"type": "AdamW"}}) == "FusedAdam"
    assert deepspeed_adamw({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, cuda=True) == "foreach"
    assert deepspeed_adamw({}) is None


def test_plan_names_and_traces_the_implementation():
    """The typed result and --json name it; foreach's whole-list intermediates make its optimizer step the peak at
    1 x 32 tokens with full checkpointing, above fused (byte-equal to MemTracker: benchmarks/results/adamw_peak.md)."""
    from hfscale.plan.api import plan

    fused, foreach = (plan("tiny-gemma3", 32, 1, precision="fp32", checkpointing="full", adamw=a) for a in ("fused", "foreach"))
    assert (fused.adamw, foreach.adamw) == ("fused", "foreach") and foreach.to_dict()["adamw"] == "foreach"
    assert foreach.prediction.peak_phase == "optimizer" and foreach.prediction.peak > fused.prediction.peak
    assert fused.prediction.trace["adamw"] == "fused"
