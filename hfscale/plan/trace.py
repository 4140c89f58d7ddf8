"""The step peak of training any transformers causal LM, traced from its own code on fake tensors.

`trace_step` builds the model from its config under torch's `FakeTensorMode` (CPU fake tensors: no
weights are allocated, shapes are full size), runs transformers' real forward, backward and an AdamW
step twice, and accounts every live tensor with torch's `MemTracker`
(`torch.distributed._tools.mem_tracker`), one tracker context per phase so each phase's peak is its
own. Step 1 differs from later steps: AdamW creates its two moments inside the first `step()`, and
gradients do not exist yet in the first forward. Steady steps (2+) are the same as each other.

What is traced is what this module runs, per rank without sharding (ZeRO-0 / DDP):
  precision  fp32          fp32 weights, gradients, AdamW states
             bf16          bf16 weights and gradients, fp32 master weights + AdamW states (DeepSpeed's
                           bf16 / ZeRO layout: master weights are `other` in the breakdown; each step
                           upcasts the gradient into the master's .grad, steps, copies back)
             bf16-autocast fp32 weights, bf16 compute under torch.autocast (accelerate's DDP/FSDP
                           mixed precision); gradients and AdamW fp32
             bf16-pure     bf16 weights, gradients and AdamW states
  checkpointing off | full | every:K through `hfscale.scale.checkpointing` (non-reentrant, as the recipes run it)
  attention  sdpa | eager (transformers' attn_implementation)
  adapter    lora_rank > 0: LoRA or DoRA (`adapter`) through hfscale.scale.adapters.apply_adapter, the recipe's targets
             (DoRA's magnitude vectors train, and its forward's weight norms are traced); QLoRA's NF4 kernels
             (bitsandbytes) have no fake implementation: peak.py lays the NF4 base over the LoRA trace (DDP)
  grad_accum 2+ traces two micro batches per step, so the second forward runs with gradients alive.
  packing    False: each row one sequence (no mask: sdpa's causal path); True: each row packed with documents
             (`packed_rows`, hfscale.models.documents' contract), run as a packed training step runs it
             (use_cache=False), so transformers builds the block-diagonal [B, 1, S, S] mask of each layer type
             (bool for sdpa, the compute dtype for eager) -- what the kernel gets; flash varlen builds none, which is
             the unpacked trace's count (plus (D + 1) int32 offsets).

Fidelity (CPU only): the trace equals a real CPU run's MemTracker numbers to the byte on the checked
architectures, with and without checkpointing (tests/test_trace.py). It was 0.1-2.2% higher in forward with
checkpointing until `_unpacked_rows`: without a cache transformers could not read fake position ids and built a
B x 1 x S x S mask no real run has (which also sent CUDA's attention to the memory-efficient kernel). CUDA's attention kernels (flash / memory-efficient) save
other tensors than CPU's: `kernels="cuda"` traces with their fake implementations (`kernels.py`; not compared
with a GPU run); each trace says which kernels it assumes and how many attention calls took each. Allocator
overheads (caching, fragmentation, CUDA context) are not in any traced number.
Ops with no fake kernel or a data-dependent output shape (some MoE routers) raise `TraceError` naming
the model type and the op; nothing is guessed.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from ..util.errors import HfscaleError
from ..scale.optim import ADAMW, DEFAULT_ADAMW, build_adamw  # torch AdamW's implementations: one home
from .kernels import KERNELS, cuda_attention
from .tracker import KINDS, PhasePeak, phase_peak as _phase, step_tracker

PRECISIONS = ("fp32", "bf16", "bf16-autocast", "bf16-pure")


class TraceError(HfscaleError):
    """The model cannot be traced on fake tensors (unknown architecture, op without a fake kernel)."""


@dataclass(frozen=True)
class StepTrace:
    """Phase peaks of one rank's training step. `micro` holds (forward, backward) of step 1's micro
    batches: one, or two when accumulation was traced (the second runs with gradients alive). Steady
    steps add `state_bytes` (AdamW's moments, created in step 1's optimizer step) to those phases."""

    model_type: str
    precision: str
    attention: str
    checkpointing: str
    micro_batch: int
    seq_len: int
    lora_rank: int
    micro: list[dict[str, PhasePeak]]
    optimizer_step1: PhasePeak
    optimizer_steady: PhasePeak
    state_bytes: int
    params: int
    trainable_params: int
    largest_module_param_bytes: int
    seconds: float
    kernels: str = "cpu"
    packing: bool = False  # rows packed with documents: the block-diagonal masks counted (see the module docstring)
    attention_kernels: dict = field(default_factory=dict)  # cuda: kernel -> calls per micro batch (recompute too)
    depth: list[int] | None = None  # the two depths a scaled trace was extrapolated from (peak.py)
    # per micro batch's backward: gradient arrivals in order ([param index, elements, bytes, kinds], see
    # _micro_steps); empty for traces scaled in depth. param_numels: trainable parameters in optimizer order
    grad_arrivals: list = field(default_factory=list)
    param_numels: list = field(default_factory=list)

    def phases(self, steady: bool = True, grad_accum: int = 1) -> dict[str, PhasePeak]:
        """forward / backward / optimizer peaks of step 1 or of a steady step, for `grad_accum` micro batches."""
        out = {ph: self._micro_peak(ph, steady, grad_accum) for ph in ("forward", "backward")}
        out["optimizer"] = self.optimizer_steady if steady else self.optimizer_step1
        return out

    def forward_in_layers(self, steady: bool = True, grad_accum: int = 1) -> PhasePeak | None:
        """The forward's peak while the decoder layers run (from the first layer's start to the last one's end), as
        `phases` gives the forward's: where FSDP2 holds a layer gathered. None where the trace has no decoder layers."""
        return self._micro_peak("forward_layers", steady, grad_accum)

    def _micro_peak(self, ph: str, steady: bool, grad_accum: int) -> PhasePeak | None:
        if grad_accum > 1 and len(self.micro) < 2:
            raise ValueError("this trace has one micro batch; trace with grad_accum=2 to predict accumulation")
        micros = self.micro[: 1 if grad_accum == 1 else 2]
        if any(ph not in m for m in micros):
            return None
        p = max((m[ph] for m in micros), key=lambda x: x.bytes)
        if steady:  # AdamW's moments, created in step 1's optimizer step
            p = PhasePeak(p.bytes + self.state_bytes,
                          {**p.breakdown, "optimizer": p.breakdown.get("optimizer", 0) + self.state_bytes})
        return p

    def prediction(self, grad_accum: int = 1) -> dict:
        """The keys `hfscale plan --json` reports under prediction (fixed names scripts can rely on)."""
        steady, step1 = self.phases(True, grad_accum), self.phases(False, grad_accum)
        at = max(steady, key=lambda k: steady[k].bytes)
        return {
            "peak": steady[at].bytes,
            "peak_step1": max(p.bytes for p in step1.values()),
            "peak_phase": at,
            "phases": {k: v.bytes for k, v in steady.items()},
            "phases_step1": {k: v.bytes for k, v in step1.items()},
            "peak_breakdown": dict(steady[at].breakdown),
            "trace": {"kernels": self.kernels, "seconds": round(self.seconds, 2), "precision": self.precision,
                      "attention": self.attention, "checkpointing": self.checkpointing, "grad_accum": grad_accum,
                      "packing": self.packing,
                      "attention_kernels": self.attention_kernels, "traced_layers": self.depth,
                      "assumes": ASSUMES if self.kernels == "cpu" else ASSUMES_CUDA},
        }

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StepTrace":
        pp = lambda x: PhasePeak(**x)  # noqa: E731
        return cls(**{**d, "micro": [{k: pp(v) for k, v in m.items()} for m in d["micro"]],
                      "optimizer_step1": pp(d["optimizer_step1"]), "optimizer_steady": pp(d["optimizer_steady"])})


ASSUMES = ("CPU kernels (CUDA flash / memory-efficient attention save different tensors); "
           "no allocator caching, fragmentation or CUDA context")
ASSUMES_CUDA = ("CUDA attention kernels as torch's dispatcher picks them on A100 / H100 (flash without a mask in "
                "fp16/bf16, math for grouped K/V heads flash cannot take, else memory-efficient; not cuDNN), traced with "
                "their fake implementations, not compared with a GPU run; no allocator caching, fragmentation or CUDA context")


def _build(config, precision: str, attention: str, lora_rank: int, adapter: str = "lora"):
    """The model as the recipe trains it: with `lora_rank` > 0, the adapter of kind `adapter` (lora / dora) applied
    by hfscale.scale.adapters.apply_adapter (the recipe's targets: every decoder q/k/v/o/gate/up/down)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if precision in ("bf16", "bf16-pure") else torch.float32
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=dtype)
    if lora_rank:
        from ..scale.adapters import AdapterSpec, apply_adapter

        model = apply_adapter(model, AdapterSpec(adapter, rank=lora_rank))
    return model


def _materialize_fake(model):
    """A model built on the meta device, given fake CPU storage (inside FakeTensorMode), ties restored.
    Building on meta first is faster than initialising under fake tensors and lets peft wrap layers (its
    `.to()` cannot swap fake parameters)."""
    model.to_empty(device="cpu")
    model.get_base_model().tie_weights() if hasattr(model, "get_base_model") else model.tie_weights()
    return model


class _Optimizer:
    """AdamW as the precision runs it; bf16 keeps fp32 master copies and steps those, their fp32 gradients
    counted as gradients. `adamw`: torch's implementation (hfscale.scale.optim), which decides the step's
    temporaries: fused (what the recipes build and transformers Trainer's default; like DeepSpeed's one-kernel
    step), foreach (torch's default on CUDA: whole-list intermediates) or forloop (torch's default on CPU: one
    parameter's intermediates at a time)."""

    def __init__(self, model, precision: str, adamw: str = DEFAULT_ADAMW):
        import torch

        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = self.holders = None
        self.mt = None
        if precision == "bf16":
            self.master = [torch.nn.Parameter(p.detach().float()) for p in self.params]
            self.holders = []
            for m in self.master:
                h = torch.nn.Module()
                h.register_parameter("master", m)
                self.holders.append(h)
        self.opt = build_adamw(self.master or self.params, adamw, lr=1e-4)

    def step(self):
        import torch

        if self.master is not None:
            for m, p, h in zip(self.master, self.params, self.holders):
                m.grad = p.grad.float()
                p.grad = None
                if self.mt is not None:  # the upcast gradient is a gradient; the master stays master weights
                    self.mt.track_external(h, m)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.master is not None:
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    p.copy_(m)
        for p in self.params:
            p.grad = None


def _micro_steps(model, mt, ids, precision: str, grad_accum: int, params=(), trained=None) -> tuple[list, list]:
    """(forward / backward phase peaks per micro batch, gradient arrivals per micro batch's backward).
    An arrival is [index of the parameter in `params`, its elements, bytes alive at the most until the next
    arrival, the breakdown there]; the first entry (index -1) is what precedes the first gradient. ZeRO-2
    lays its per-rank buffers over these (`zero.py`): which rank's partition fills when is set by this order."""
    import torch

    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-autocast"
                else contextlib.nullcontext())
    from transformers.modeling_layers import GradientCheckpointingLayer

    arrivals: list = []
    hooks = [p.register_post_accumulate_grad_hook(lambda q, i=i: arrivals.append((i, q.numel(), mt.ops)))
             for i, p in enumerate(params)]
    # the forward's samples are labelled "layers" from the first decoder layer's start to the last one's end (FSDP2
    # holds a layer gathered there, not at the loss: fsdp.py); the layers as fsdp.fsdp2_units counts its units
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if layers:
        hooks += [layers[0].register_forward_pre_hook(lambda *a: setattr(mt, "label", "layers")),
                  layers[-1].register_forward_hook(lambda *a: setattr(mt, "label", "head"))]
    micros, segments = [], []
    try:
        for _ in range(min(grad_accum, 2)):  # the second micro batch runs with gradients alive
            with mt.recording() as forward, mt:
                mt.label = "embedding"
                with autocast:
                    loss = _loss(model, ids, trained)
            fwd = _phase(mt)
            arrivals.clear()
            with mt.recording() if params else contextlib.nullcontext([]) as samples, mt:
                loss.backward()
            micros.append({"forward": fwd, "backward": _phase(mt),
                           **_labelled_peak(forward, "layers", "forward_layers")})
            segments.append(_segments(samples, arrivals) if params else [])
            del loss
            mt.reset_mod_stats()  # MemTracker tracks one call per module between resets
    finally:
        for h in hooks:
            h.remove()
    return micros, segments


def _labelled_peak(samples, label: str, key: str) -> dict:
    """{key: the peak of the samples labelled `label`}, {} when none is."""
    top = max((smp for smp in samples if smp.label == label), key=lambda smp: sum(smp.kinds.values()), default=None)
    return {} if top is None else {key: PhasePeak(sum(top.kinds.values()), dict(top.kinds))}


def _segments(samples, arrivals) -> list:
    """[param index, elements, peak bytes, kinds at the peak] from each arrival to the next (samples are in op
    order and taken only when the live bytes change: a span without one holds the last earlier sample)."""
    import bisect

    ops = [smp.op for smp in samples]
    out, bounds = [], [(-1, 0, -1), *arrivals]
    for j, (i, n, op) in enumerate(bounds):
        lo = max(bisect.bisect_right(ops, op) - 1, 0)  # the state at the arrival, then every change before the next
        hi = bisect.bisect_left(ops, bounds[j + 1][2]) if j + 1 < len(bounds) else len(ops)
        span = samples[lo:max(hi, lo + 1)]
        top = max(span, key=lambda smp: sum(smp.kinds.values()), default=None)
        kinds = dict(top.kinds) if top is not None else {}
        out.append([i, n, sum(kinds.values()), kinds])
    return out


def _optimizer_step(opt, mt) -> PhasePeak:
    with mt:
        opt.step()
    mt.reset_mod_stats()
    return _phase(mt)


def _state_bytes(opt) -> int:
    import torch

    return sum(t.untyped_storage().nbytes() for st in opt.opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor))


def packed_rows(micro_batch: int, seq_len: int, vocab_size: int, docs: int = 4) -> dict:
    """A packed batch by hfscale.models.documents' contract for the traced step: each row `docs` documents of
    seq_len // docs tokens (the last one takes the rest). The masks' bytes depend on B and S only; with at least
    two documents per row transformers finds the rows packed."""
    import torch

    docs = _docs_per_row(seq_len, docs)
    n = seq_len // docs
    pos = torch.cat([torch.arange(n)] * (docs - 1) + [torch.arange(seq_len - (docs - 1) * n)])
    ids = torch.randint(0, vocab_size, (micro_batch, seq_len))
    labels = ids.masked_fill(pos == 0, -100)
    return {"input_ids": ids, "labels": labels, "position_ids": pos.expand(micro_batch, seq_len).clone()}


def _docs_per_row(seq_len: int, docs: int = 4) -> int:
    return max(1, min(docs, seq_len))


def trained_rows(micro_batch: int, seq_len: int, vocab_size: int, trained: int) -> dict:
    """Rows of one sequence each (positions 0..S-1) as a packed batch whose labels train `trained` tokens: the
    first ones in row order after each row's first token (which is never trained). What the head's memory depends
    on is their count (hfscale.models.loss runs the head at the trained positions only), not where they are."""
    import torch

    if not 0 <= trained <= micro_batch * (seq_len - 1):
        raise HfscaleError(f"trained tokens {trained} must be 0..{micro_batch * (seq_len - 1)} for micro batch "
                           f"{micro_batch} x seq_len {seq_len} (a row's first token is never trained)")
    ids = torch.randint(0, vocab_size, (micro_batch, seq_len))
    keep = torch.zeros(micro_batch, seq_len, dtype=torch.bool)
    flat = torch.arange(micro_batch * (seq_len - 1)) < trained
    keep[:, 1:] = flat.reshape(micro_batch, seq_len - 1)
    return {"input_ids": ids, "labels": ids.masked_fill(~keep, -100),
            "position_ids": torch.arange(seq_len).expand(micro_batch, seq_len).clone()}


def _loss(model, batch, trained=None):
    """One micro batch's loss as the recipes compute it: full blocks (labels = inputs) or a packed batch. The loss
    runs the LM head at the trained positions only (hfscale.models.loss.trained_positions), a count fake tensors
    cannot read: `trained` where the rows were made with it (`trained_rows`), else `packed_rows` trains all but
    each document's first token, (seq_len - docs) per row."""
    from torch._subclasses.fake_tensor import FakeTensor

    from ..models.loss import lm_loss

    if trained is None and isinstance(batch, dict) and isinstance(batch["labels"], FakeTensor):
        rows, seq_len = batch["labels"].shape
        trained = rows * (seq_len - _docs_per_row(seq_len))
    return lm_loss(model, batch, trained=trained)


def _setup(model, config, micro_batch, seq_len, precision, checkpointing, adamw=DEFAULT_ADAMW, levers=None, packing=False,
           trained=None):
    import torch

    from ..scale.checkpointing import apply_checkpointing_

    apply_checkpointing_(model, checkpointing)
    if levers is not None:  # long-context tiling (hfscale.scale.long_context); the offload is not traced here
        from ..scale.long_context import apply_levers_

        apply_levers_(model, levers)
    model.train()
    opt = _Optimizer(model, precision, adamw)
    ids = (packed_rows(micro_batch, seq_len, config.vocab_size) if packing
           else trained_rows(micro_batch, seq_len, config.vocab_size, trained) if trained is not None
           else torch.randint(0, config.vocab_size, (micro_batch, seq_len)))
    mt = step_tracker()
    mt.track_external(model, opt.opt, *(opt.master or []))
    opt.mt = mt
    return opt, ids, mt


TRACED_ADAPTERS = ("lora", "dora")


def _check(precision, micro_batch, seq_len, grad_accum, lora_rank, checkpointing, adamw=DEFAULT_ADAMW, adapter="lora"):
    from ..scale.checkpointing import parse_checkpointing

    if adapter not in TRACED_ADAPTERS:
        raise HfscaleError(f"adapter {adapter!r} cannot be traced (QLoRA's NF4 kernels have no fake implementation); "
                           f"trace one of {', '.join(TRACED_ADAPTERS)}")

    if precision not in PRECISIONS:
        raise HfscaleError(f"precision {precision!r} cannot be traced; use one of {', '.join(PRECISIONS)}")
    if micro_batch < 1 or seq_len < 1 or grad_accum < 1 or lora_rank < 0:
        raise HfscaleError(f"micro batch, sequence length and grad accumulation must be >= 1 and LoRA rank >= 0 "
                           f"(got {micro_batch}, {seq_len}, {grad_accum}, {lora_rank})")
    parse_checkpointing(checkpointing)
    if adamw not in ADAMW:
        raise HfscaleError(f"AdamW implementation {adamw!r} cannot be traced; use one of {', '.join(ADAMW)}")


def measure_steps(config, micro_batch: int, seq_len: int, precision: str = "fp32", attention: str = "sdpa",
                  checkpointing: str = "off", lora_rank: int = 0, grad_accum: int = 1, steps: int = 2,
                  adamw: str = DEFAULT_ADAMW, levers=None, packing: bool = False,
                  adapter: str = "lora", trained: int | None = None) -> list[dict[str, PhasePeak]]:
    """Run `steps` whole training steps for real (random weights) under the same tracker: each step's phase
    peaks, what `trace_step` is checked against. Run it first in a fresh process: a second real run in
    the same process was measured to count one hidden-state tensor fewer (2.25 MiB on the tiny Gemma)."""
    import copy

    import torch

    _check(precision, micro_batch, seq_len, grad_accum, lora_rank, checkpointing, adamw, adapter)
    config = copy.deepcopy(config)
    torch.manual_seed(0)
    model = _build(config, precision, attention, lora_rank, adapter)
    opt, ids, mt = _setup(model, config, micro_batch, seq_len, precision, checkpointing, adamw, levers, packing, trained)
    out = []
    for _ in range(steps):
        micros, _ = _micro_steps(model, mt, ids, precision, grad_accum, trained=trained)
        out.append({ph: max((m[ph] for m in micros), key=lambda x: x.bytes) for ph in ("forward", "backward")}
                   | {"optimizer": _optimizer_step(opt, mt)})
    return out


def trace_step(config, micro_batch: int, seq_len: int, precision: str = "fp32", attention: str = "sdpa",
               checkpointing: str = "off", lora_rank: int = 0, grad_accum: int = 1,
               optimizer_only: bool = False, adamw: str = DEFAULT_ADAMW, kernels: str = "cpu",
               optimizer: bool = True, levers=None, packing: bool = False, adapter: str = "lora",
               trained: int | None = None) -> StepTrace:
    """Trace step 1 of training the model `config` describes on fake tensors, and the steady optimizer step.
    `optimizer_only` skips forward and backward (`micro` is empty): both optimizer steps then run on
    gradients shaped as backward makes them (used to scale a trace to full depth, `peak.py`); `optimizer=False`
    skips the optimizer steps (the shallower traces a scaled trace reads forward and backward from).
    `levers`: hfscale.scale.long_context.Levers whose tiled loss / MLP the traced step runs (the offload
    moves tensors to host memory, which a CPU trace cannot tell apart: hfscale.plan.long_context models it).
    `packing`: rows packed with documents (`packed_rows`): the block-diagonal masks sdpa / eager get are counted.
    `adapter`: the kind (lora / dora) of the adapter of rank `lora_rank` (0: full fine-tuning).
    `trained`: rows whose labels train that many tokens per micro batch (`trained_rows`, unpacked): the LM head and
    the loss at those positions only, as hfscale.models.loss runs them; None: full blocks (every position).

    Forward and backward are traced once: a steady step's differ from step 1's only by the optimizer
    states then alive (gradients are freed after each step). The optimizer step is traced twice (step 1
    creates the states; the steady one runs on gradients shaped as backward makes them).
    `tests/test_trace.py` checks both against whole real steps."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import copy

    _check(precision, micro_batch, seq_len, grad_accum, lora_rank, checkpointing, adamw, adapter)
    if kernels not in KERNELS:
        raise HfscaleError(f"attention kernels {kernels!r} cannot be traced; use one of {', '.join(KERNELS)}")
    config = copy.deepcopy(config)  # building and checkpointing set fields on the config; the caller's stays as given
    model_type = getattr(config, "model_type", "?")
    t0 = time.perf_counter()
    try:
        with torch.device("meta"):
            model = _build(config, precision, attention, lora_rank, adapter)
        with (FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu"), _quiet_fake_errors(), _cpu_grouped_mm(),
              contextlib.nullcontext() if packing else _unpacked_rows()):
            opt, ids, mt = _setup(_materialize_fake(model), config, micro_batch, seq_len, precision, checkpointing,
                                  adamw, levers, packing, None if packing else trained)
            counts: Counter = Counter()
            with cuda_attention(counts) if kernels == "cuda" else contextlib.nullcontext():
                micros, arrivals = (([], []) if optimizer_only
                                    else _micro_steps(model, mt, ids, precision, grad_accum, opt.params,
                                                      None if packing else trained))
            opts = [PhasePeak(0, {})] * 2 if not optimizer else []
            for step in range(2 if optimizer else 0):
                if step or optimizer_only:
                    for p in opt.params:
                        p.grad = torch.zeros_like(p)
                    mt.track_external(model)  # the new .grad tensors count as gradients
                opts.append(_optimizer_step(opt, mt))
            opt1, opt2 = opts
            params = sum(p.numel() for p in model.parameters())
            largest = max((sum(p.untyped_storage().nbytes() for p in m.parameters(recurse=False))
                           for m in model.modules()), default=0)
    except HfscaleError:
        raise
    except Exception as e:  # an architecture or op fake tensors cannot run: name it, guess nothing
        op = getattr(e, "func", None) or _failing_op(e)
        hint = (" (custom code needs trust_remote_code)" if isinstance(e, (KeyError, ValueError))
                and ("model type" in str(e) or "Unrecognized" in str(e)) else "")
        raise TraceError(f"cannot trace model_type {model_type!r} on fake tensors{hint}"
                         f"{f' (op {op})' if op is not None else ''}: {_line(e)}") from None
    return StepTrace(model_type, precision, attention, checkpointing, micro_batch, seq_len, lora_rank, micros,
                     opt1, opt2, _state_bytes(opt), params, sum(p.numel() for p in opt.params), largest,
                     time.perf_counter() - t0, kernels=kernels, packing=packing,
                     attention_kernels={k: v // len(micros) for k, v in counts.items()} if micros else {},
                     grad_arrivals=arrivals,
                     param_numels=[p.numel() for p in opt.params])


class _FakeHost:
    """save_on_cpu's hooks as a GPU run sees them, for the trace: pack keeps only the shape and dtype (the tensor
    leaves the traced device when nothing else holds it), unpack makes a new tensor of that shape (the copy back)."""

    @staticmethod
    def pack_hook(t):
        return tuple(t.shape), t.dtype

    @staticmethod
    def unpack_hook(packed):
        import torch

        return torch.empty(packed[0], dtype=packed[1])


def _offloaded(model, levers):
    """The forward's context for `levers`: the activation offload (`scale.long_context.Offload` over `_FakeHost`)
    or nothing."""
    if levers is None or not levers.offload_activations:
        return contextlib.nullcontext()
    from ..scale.long_context import Offload

    return Offload(model, host=_FakeHost())()


def phase_trace(config, seq_len: int, precision: str = "bf16", checkpointing: str = "full", levers=None,
                kernels: str = "cpu", micro_batch: int = 1) -> dict[str, int]:
    """The largest activations + temporaries (no model states) of each phase of one traced micro batch, as
    hfscale.plan.long_context.phase_bytes splits a step: "forward", "loss" (backward until the gradient reaches the
    decoder's output) and "layers" (the rest of backward). What that per-phase model is checked against. With
    `levers.offload_activations` the saved tensors leave the traced device in forward and come back when backward
    unpacks them (`_FakeHost`), as torch's save_on_cpu moves them off a GPU."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import copy

    _check(precision, micro_batch, seq_len, 1, 0, checkpointing)
    config = copy.deepcopy(config)
    with torch.device("meta"):
        model = _build(config, precision, "sdpa", 0)
    peaks: dict[str, int] = {}
    with (FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu"), _quiet_fake_errors(), _cpu_grouped_mm(),
          _unpacked_rows()):
        opt, ids, mt = _setup(_materialize_fake(model), config, micro_batch, seq_len, precision, checkpointing,
                              levers=levers)

        def decoder_out(module, args, out):
            h = out.last_hidden_state
            if h.requires_grad:
                h.register_hook(lambda g: setattr(mt, "label", "layers"))

        model.get_decoder().register_forward_hook(decoder_out)
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-autocast"
                    else contextlib.nullcontext())
        with cuda_attention() if kernels == "cuda" else contextlib.nullcontext():
            with mt.recording() as fwd, mt, autocast, _offloaded(model, levers):
                mt.label = "forward"
                loss = model(input_ids=ids, labels=ids).loss
            with mt.recording() as bwd, mt:
                mt.label = "loss"
                loss.backward()
        for smp in [*fwd, *bwd]:
            peaks[smp.label] = max(peaks.get(smp.label, 0), smp.kinds.get("activations", 0) + smp.kinds.get("temporaries", 0))
    return peaks


def _grouped_mm_shape(a, b, offs) -> tuple:
    """aten._grouped_mm's output shape (its four layouts: 2-D x 3-D experts forward, 2-D x 2-D per-group weight
    gradient, 3-D x 2-D, 3-D x 3-D batched)."""
    if a.dim() == 2 and b.dim() == 3:
        return a.shape[0], b.shape[-1]
    if a.dim() == 2 and b.dim() == 2:
        return offs.shape[0], a.shape[0], b.shape[1]
    if a.dim() == 3 and b.dim() == 2:
        return a.shape[1], b.shape[1]
    return a.shape[0], a.shape[1], b.shape[-1]


@contextlib.contextmanager
def _cpu_grouped_mm():
    """MoE experts (transformers' default grouped_mm path) in fp32: torch 2.13's fake `aten._grouped_mm` takes bf16
    only (CUDA's rule) while the CPU kernel a real run uses takes fp32 too. Under this mode an fp32 call returns an
    empty tensor of the kernel's output shape and dtype (all the trace needs: the bytes), for forward and backward;
    others go to the fake kernel. Measured: Mixtral / Qwen3-MoE fp32 and autocast traces equal real CPU steps
    (benchmarks/results/plan_default.md)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    op = torch.ops.aten._grouped_mm.default

    class CpuGroupedMM(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is op and args[0].dtype == torch.float32:
                offs = args[2] if len(args) > 2 else kwargs.get("offs")
                dtype = kwargs.get("out_dtype") or (args[4] if len(args) > 4 else None) or args[0].dtype
                return torch.empty(_grouped_mm_shape(args[0], args[1], offs), dtype=dtype, device=args[0].device)
            return func(*args, **kwargs)

    with CpuGroupedMM():
        yield


@contextlib.contextmanager
def _unpacked_rows():
    """The traced rows are one sequence each (position ids 0..S-1), as transformers finds them in a real run; on fake
    tensors it cannot read the position ids, so it assumes packed sequences and builds the whole B x 1 x S x S mask
    (transformers.masking_utils.find_packed_sequence_indices, reached without a cache, i.e. whenever checkpointing
    turns use_cache off): an S^2 tensor no real run has (14.4 TB of bool at 3.8M tokens), and on CUDA kernels a masked
    attention call is memory-efficient instead of flash. Under this context the check answers what it answers for
    the trace's inputs in a real run: not packed (None)."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def _quiet_fake_errors():
    """FakeTensorMode logs a traceback for every op it cannot run; the TraceError says it in one line."""
    import logging

    log = logging.getLogger("torch._subclasses.fake_tensor")
    level, log.level = log.level, logging.CRITICAL
    try:
        yield
    finally:
        log.level = level


def _failing_op(e: Exception):
    """The aten op fake tensors were running when `e` was raised (FakeTensorMode's dispatch frame)."""
    import torch

    tb, op = e.__traceback__, None
    while tb is not None:
        f = tb.tb_frame.f_locals.get("func")
        if isinstance(f, torch._ops.OpOverload):
            op = f
        tb = tb.tb_next
    return op


def _line(e: Exception) -> str:
    from ..util.errors import first_line

    return first_line(e, limit=200)


__all__ = ["ADAMW", "PRECISIONS", "KINDS", "PhasePeak", "StepTrace", "TraceError", "measure_steps", "phase_trace",
           "trace_step"]
