"""torch's MemTracker as hfscale runs it: one home for how live bytes are counted and named, used by the
fake-tensor step trace (`trace.py`) and by the measured timeline (`hfscale.proofs.profile`).

`StepTracker` is `torch.distributed._tools.mem_tracker.MemTracker` minus its per-module peak bookkeeping
(which costs O(modules) per op: a Gemma 3 1B forward at 1024 tokens took 6.6 s tracked against 1.0 s
untracked, 4.4 s of it there), plus an optional timeline: with `record=True` every op that changes the
live total appends one `Sample` (op index, phase label, bytes by kind). How tensors are classified,
counted and freed is MemTracker's own.

One change to what MemTracker sees, made here for both users: its `ModTracker` hooks no module's inputs.
ModTracker's forward pre-hook puts a `register_multi_grad_hook(inputs, mode="all")` on every input that needs
grad, and that hook's closure holds the inputs' `grad_fn`s while being stored on those same nodes: a reference
cycle (node -> hook -> closure -> node) that only Python's cyclic GC frees. A graph that backward runs through
loses its saved tensors anyway; one it never runs through keeps them until the GC happens to run. peft's DoRA
builds one per layer and step (`lora_B(lora_A(eye(in)))`, used detached): its saved in x in identity
(16.8 MB for a 2048-wide down_proj) outlived the layer under the tracker, freed by reference count without it
(two DoRA Linears 768 -> 2048 -> 768, 3 steps, GC off: 6 identities alive under the tracker, none without), so
a tracked DoRA step measured whenever the GC ran (two traces of one DDP step: 590.6 / 585.9 MB). Those hooks
only pop the module's name from `parents` after its backward, which hfscale never reads (MemTracker's
per-module peaks are dropped, below); the name is popped at the end of backward instead, by ModTracker's own
route for modules whose inputs need no grad.
"""

from __future__ import annotations

from dataclasses import dataclass

# MemTracker's reference types -> the names hfscale reports ("Other": tensors handed to track_external
# that are neither parameters nor optimizer states: fp32 master weights, DeepSpeed's flat buffers)
KINDS = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients", "Activation": "activations",
         "Temp": "temporaries", "Optstate": "optimizer", "Other": "master_weights"}


@dataclass(frozen=True)
class PhasePeak:
    bytes: int
    breakdown: dict[str, int]  # kind -> bytes alive at this phase's peak


@dataclass(frozen=True)
class Sample:
    op: int            # index of the op after which this was taken (0 = a phase's start)
    label: str         # what the caller said is running ("step 2 backward")
    kinds: dict        # kind -> bytes alive


def _named(snap: dict) -> dict[str, int]:
    return {KINDS.get(getattr(k, "value", k), str(k)): int(v) for k, v in snap.items() if k != "Total" and v}


def step_tracker(record: bool = False):
    """A new StepTracker (see the module docstring). `tracker.label` names what runs now (the timeline's
    phase); `tracker.samples` holds the timeline when `record` is set."""
    import contextlib
    from copy import deepcopy

    import torch
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from torch.distributed._tools.mod_tracker import ModTracker

    class InputHooklessModTracker(ModTracker):
        def _fw_pre_hook(self, mod, input):
            # as if no input needed grad: no multi-grad hook on the inputs' nodes (the cycle in the module
            # docstring); the user pre-forward hook (MemTracker's) sees no inputs, which only its per-module
            # input bytes read
            super()._fw_pre_hook(mod, ())

    class StepTracker(MemTracker):
        def __init__(self):
            super().__init__()
            self._mod_tracker = InputHooklessModTracker()
            self.record, self.label, self.samples, self.ops, self._last = record, "", [], 0, None
            self._watched: list = []  # modules handed to track_external: their gradients are hooked per context

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            # MemTracker hooks every parameter's gradient, which raises on frozen ones (LoRA's base): hook
            # the trainable ones only
            out = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if install_grad_hooks:
                for p in module.parameters():
                    if p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                        self._param_to_grad_hook_handles[p] = (p.register_hook(self._as_grad),
                                                               p.register_post_accumulate_grad_hook(
                                                                   lambda q: self._as_grad(q.grad)))
            return out

        def _as_grad(self, grad) -> None:
            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        def track_as_parameters(self, *tensors) -> None:
            """Count `tensors` as parameters: what a frozen weight holds beside its data (bitsandbytes' NF4 quant
            state), which MemTracker's track_external would not see as a parameter's."""
            for t in tensors:
                self._update_and_maybe_create_winfos(t, _MemRefType.PARAM)

        def track_external(self, *external) -> None:
            super().track_external(*external)
            self._watched.extend(x for x in external if isinstance(x, torch.nn.Module))

        def __enter__(self):
            # MemTracker drops its gradient hooks when a context closes and installs them again in the next
            # forward: a context around backward alone would count new gradients as temporaries
            super().__enter__()
            if self._depth == 1:
                for m in self._watched:
                    self._track_module_params_and_buffers(m)
            return self

        def _update_peak_stats(self, peak_state) -> None:
            self.ops += 1
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = deepcopy(snap)
            if self.record:
                self.sample()

        def current(self) -> dict[str, int]:
            """Bytes alive now by kind, summed over devices."""
            out: dict[str, int] = {}
            for snap in self._curr_mem_snap.values():
                for k, v in _named(snap).items():
                    out[k] = out.get(k, 0) + v
            return out

        @contextlib.contextmanager
        def recording(self):
            """Record the timeline within this block only; yields the list its samples go to."""
            saved = self.record, self.samples, self._last
            self.record, self.samples, self._last = True, [], None
            try:
                yield self.samples
            finally:
                self.record, self.samples, self._last = saved

        def sample(self) -> None:
            kinds = self.current()
            if kinds != self._last:  # only changes: a step of the tiny model is ~4,000 ops
                self.samples.append(Sample(self.ops, self.label, kinds))
                self._last = kinds

    return StepTracker()


def phase_peak(mt) -> PhasePeak:
    """The peak of the tracker's last context (MemTracker resets its peak on entry), by kind."""
    snap = mt.get_tracker_snapshot("peak")
    dev = max(snap.values(), key=lambda d: d["Total"]) if snap else {"Total": 0}
    return PhasePeak(int(dev["Total"]), _named(dev))


__all__ = ["KINDS", "PhasePeak", "Sample", "phase_peak", "step_tracker"]
