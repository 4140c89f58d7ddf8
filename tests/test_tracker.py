"""hfscale's MemTracker (hfscale/plan/tracker.py), which `hfscale profile` and the plan's trace both run: a tracked
step holds what the untracked step holds. In-process, real peft DoRA layers, no launch."""

import gc

import pytest


def _dora_step():
    """Two peft DoRA Linears 768 -> 2048 -> 768 (the 101.6M benchmark model's MLP widths) and a function running
    one training step (its gradients exist already: the steady step)."""
    import torch
    from peft import LoraConfig, get_peft_model

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(768, 2048), torch.nn.Linear(2048, 768)

        def forward(self, x):
            return self.down(self.up(x))

    torch.manual_seed(0)
    model = get_peft_model(MLP(), LoraConfig(r=16, target_modules=["up", "down"], use_dora=True))
    x = torch.randn(4, 768)

    def step():
        model(x).sum().backward()

    step()
    return model, step


def _allocator_peak(step) -> int:
    """Bytes above the start at the peak of `step`, from torch's CPU allocator (the profiler's memory events): no
    module hooks, no tracker."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_dora_step_under_the_tracker_is_the_untracked_step():
    """peft's DoRA builds its delta weight lora_B(lora_A(eye(in))) each forward and uses it detached; under torch's
    ModTracker the module-input hooks made that graph (with its 2048 x 2048 identity, 16.8 MB) a reference cycle only
    the GC freed, so with the GC off each step left 19.1 MB more alive (peaks 51.2 / 70.7 / 89.9 MB) and with it on
    the peak depended on when it ran. Now the tracked peak is the allocator's peak of the same step without the
    tracker, every step, and the GC finds nothing the tracker counts."""
    from hfscale.plan.tracker import phase_peak, step_tracker

    model, step = _dora_step()
    gc.collect()
    gc.disable()
    try:
        real = _allocator_peak(step)
        mt = step_tracker()
        mt.track_external(model)
        with mt:
            start = sum(mt.current().values())
            peaks = []
            for _ in range(3):
                with mt:
                    step()
                peaks.append(phase_peak(mt).bytes - start)
                mt.reset_mod_stats()
            alive = sum(mt.current().values())
            gc.collect()
            assert sum(mt.current().values()) == alive, "the tracked step left cyclic garbage the tracker counts"
    finally:
        gc.enable()
    # the allocator sees 8 B more (a scalar outside any tensor the tracker counts); the cycle cost 19.1 MB per step
    assert all(p == pytest.approx(real, abs=64) for p in peaks), (peaks, real)
