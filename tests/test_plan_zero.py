"""hfscale/plan/zero.py's per-rank ZeRO-3 rule, held to ranks measured with `hfscale profile` (MemTracker inside 2 CPU
ranks over gloo). The plan is computed here (no launch); the measured bytes are quoted from the run named."""

from hfscale.models import load_config
from hfscale.plan.peak import step_prediction

CFG = load_config("tiny-gemma3")


def test_stage3_backward_releases_modules_and_reduces_gradients():
    """Micro 1 x 8 tokens, fp32, fused AdamW, where the model states outweigh the activations (as on the 101.6M Gemma 3
    of benchmarks/results/adapters.md): measured 47,286,593 B on both ranks, step 1 36,170,977 (`hfscale profile --config
    accelerate_configs/zero3.yaml --num-processes 2 --micro-batch 1 --seq-len 8 --precision fp32`, AMD EPYC host,
    2026-12-07). The backward walked over the gradient arrivals (a module's parameters released after its backward, a
    gradient alive from its arrival to its bucket's reduction) is within 0.1% (+0.05%); the rule it replaced (every
    traced gradient alive 1/N, every parameter gathered to the end of backward) planned 56,043,000 (+18.5%)."""
    p = step_prediction(CFG, 1, 8, "fp32", "eager", "off", zero=3, dp=2, engine="deepspeed", adamw="fused")
    assert p["peak_phase"] == "backward" and abs(p["peak"] / 47_286_593 - 1) < 1e-3, p["peak"]
    assert abs(p["peak_step1"] / 36_170_977 - 1) < 1e-3
    # no more than two gradients (the arriving one and one pending) live outside DeepSpeed's buffers
    assert p["peak_breakdown"].get("gradients", 0) <= 2 * 4 * 786_432
