"""One optimizer step's engine calls, the same on DDP, FSDP2 and DeepSpeed: the recipes' loop (`train.loop`),
the profiler's worker and users' own accelerate loops call these so a loop has separate backward and optimizer
phases whatever engine accelerate prepared."""

from __future__ import annotations

from ..scale.runtime import deepspeed_engine


def backward(accelerator, loss) -> None:
    """`accelerator.backward(loss)` without the optimizer step accelerate's DeepSpeed backward also runs, so a
    loop has separate backward and optimizer phases (with `optimizer_step`); the same calls in the same order."""
    engine = deepspeed_engine(accelerator)
    if engine is None:
        accelerator.backward(loss)
        return
    engine.set_gradient_accumulation_boundary(is_boundary=accelerator.sync_gradients)
    engine.backward(loss)


def optimizer_step(accelerator, optimizer) -> None:
    """optimizer.step() + zero_grad() (skipped by accelerate between accumulation boundaries); DeepSpeed's step."""
    engine = deepspeed_engine(accelerator)
    if engine is None:
        optimizer.step()
        optimizer.zero_grad()
    elif accelerator.sync_gradients:
        engine.step()


__all__ = ["backward", "deepspeed_engine", "optimizer_step"]
