"""The typed result of predicting one strategy's memory per rank: built here, in one place, from either
the traced step (`peak.step_prediction`, the default) or the analytic terms (`memory.predict` /
`parallel.predict_parallel`, the `--fast` path and the fallback where a step cannot be traced).

`peak` is the number everything ranks on: the device bytes per rank at the step's highest point. For a
traced step that is the highest phase (forward, backward or the optimizer step) of a steady step; for the
analytic model it is the sum of its terms (weights + gradients + optimizer + activations + recompute working
set + ZeRO-3 gathered parameters + parallel buffers), which has no phases and no temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TERMS = ("weights", "gradients", "optimizer", "activations", "recompute_working", "zero3_live")


@dataclass(frozen=True)
class Prediction:
    source: str  # "trace" | "analytic"
    peak: int  # device bytes per rank (see the module docstring)
    params: int
    trainable_params: int
    offloaded_per_rank: int = 0  # bytes per rank living in host memory (CPU / NVMe offload)
    peak_step1: int | None = None  # traced only: step 1 (no optimizer states yet, gradients first made)
    peak_phase: str | None = None  # traced only: forward | backward | optimizer
    phases: dict = field(default_factory=dict)  # traced only: steady peak per phase
    phases_step1: dict = field(default_factory=dict)
    breakdown: dict = field(default_factory=dict)  # bytes by kind at the peak (traced) / by term (analytic)
    terms: dict = field(default_factory=dict)  # the analytic terms, where the model has formulas
    trace: dict | None = None  # how the step was traced (seconds, precision, kernels, assumptions)
    not_traced: str | None = None  # why the analytic model answered
    extra: dict = field(default_factory=dict)  # engine details kept for --json (phases with host memory, ...)

    @property
    def states(self) -> int:
        """Weights + gradients + optimizer states per rank on the device (a lower bound of any peak)."""
        src = self.terms or self.breakdown
        return sum(v for k, v in src.items() if k in ("weights", "gradients", "optimizer", "parameters",
                                                      "master_weights"))

    def to_dict(self) -> dict:
        """`hfscale plan --json`'s prediction object: fixed key names scripts rely on."""
        out = {"source": self.source, "peak": self.peak, "params": self.params,
               "trainable_params": self.trainable_params, "offloaded_per_rank": self.offloaded_per_rank,
               **self.terms, **self.extra}
        if self.terms:
            out["total"] = self.terms_total
        if self.source == "trace":
            out.update(peak_step1=self.peak_step1, peak_phase=self.peak_phase, phases=dict(self.phases),
                       phases_step1=dict(self.phases_step1), peak_breakdown=dict(self.breakdown), trace=self.trace)
        if self.not_traced:
            out["peak_not_traced"] = self.not_traced
        return out

    @property
    def terms_total(self) -> int:
        t = self.terms
        return sum(t.get(k, 0) for k in TERMS) + sum(t.get("parallel_buffers", {}).values())


def from_analytic(pred: dict, why: str | None = None) -> Prediction:
    """From `memory.predict` / `parallel.predict_parallel`'s dict."""
    terms = {k: pred[k] for k in TERMS}
    if "parallel_buffers" in pred:
        terms["parallel_buffers"] = dict(pred["parallel_buffers"])
    extra = {k: pred[k] for k in ("offloaded", "params_per_rank", "tokens_per_rank", "overheads_not_included") if k in pred}
    return Prediction("analytic", pred["total"], pred["params"], pred.get("trainable_params", pred["params"]),
                      pred.get("offloaded_per_rank", 0), breakdown={k: v for k, v in terms.items() if isinstance(v, int)},
                      terms=terms, not_traced=why, extra=extra)


def from_trace(step: dict, analytic: dict | None = None, buffers: dict | None = None) -> Prediction:
    """From `peak.step_prediction`'s dict; `analytic` adds the model's terms beside it (where it has formulas),
    `buffers` bytes the trace cannot see (sequence-parallel all-to-all) added to every phase."""
    add = sum((buffers or {}).values())
    phases = {k: v + add for k, v in step["phases"].items()}
    phases1 = {k: v + add for k, v in step["phases_step1"].items()}
    breakdown = dict(step["peak_breakdown"], **{k: v for k, v in (buffers or {}).items() if v})
    extra = {k: step[k] for k in ("phases_with_host", "phases_step1_with_host") if k in step}
    terms = {}
    if analytic is not None:
        terms = {k: analytic[k] for k in TERMS}
    return Prediction("trace", step["peak"] + add, step["params"], step["trainable_params"], step["offloaded_per_rank"],
                      peak_step1=step["peak_step1"] + add, peak_phase=step["peak_phase"], phases=phases,
                      phases_step1=phases1, breakdown=breakdown, terms=terms, trace=step["trace"], extra=extra)


__all__ = ["Prediction", "TERMS", "from_analytic", "from_trace"]
