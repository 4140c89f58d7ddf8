"""What the trace lays over transformers' step beyond the CPU run: CUDA's attention kernels (their fake
implementations on CPU fake tensors) and DeepSpeed stage 2's per-rank gradient buckets."""

import json

import pytest
import torch

from hfscale.plan.kernels import cuda_attention
from hfscale.plan.zero import owned, stage2_walk


def _attention(dtype, mask):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), cuda_attention() as _:
        q = torch.empty(2, 8, 128, 64, dtype=dtype, requires_grad=True)
        kv = torch.empty(2, 2, 128, 64, dtype=dtype, requires_grad=True)
        m = None if mask is None else torch.ones(2, 1, 128, 128, dtype=torch.bool).tril()
        gqa = mask is None
        k, v = (kv * 1, kv * 1) if gqa else (kv.repeat_interleave(4, 1), kv.repeat_interleave(4, 1))
        out = torch.nn.functional.scaled_dot_product_attention(q * 1, k, v, attn_mask=m, is_causal=mask is None,
                                                               enable_gqa=gqa)
        return out.grad_fn


def test_cuda_flash_saves_the_log_sum_exp_not_probabilities():
    fn = _attention(torch.bfloat16, None)
    assert fn.name() == "ScaledDotProductFlashAttentionBackward0"
    assert fn._saved_logsumexp.shape == (2, 8, 128) and fn._saved_logsumexp.dtype == torch.float32
    assert fn._saved_key.shape == (2, 2, 128, 64)  # grouped K/V heads are not repeated
    assert fn._saved_output.shape == (2, 8, 128, 64)


def test_cuda_grouped_heads_without_flash_take_the_math_kernel():
    # fp32 cannot use flash; torch documents GQA for flash and math only on CUDA: math saves the probabilities
    fn = _attention(torch.float32, None)
    saved = [getattr(fn, a) for a in dir(fn) if a.startswith("_saved_") and isinstance(getattr(fn, a), torch.Tensor)]
    assert not fn.name().startswith("ScaledDotProduct")  # composite: autograd runs through its decomposition
    seen, frontier = set(), [fn]
    while frontier and not any(t.shape[-2:] == (128, 128) for t in saved):
        node = frontier.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        saved += [getattr(node, a) for a in dir(node) if a.startswith("_saved_") and isinstance(getattr(node, a), torch.Tensor)]
        frontier += [n for n, _ in node.next_functions]
    assert any(t.shape[-2:] == (128, 128) for t in saved)  # S x S attention probabilities kept for backward


@pytest.mark.parametrize("dtype,mask", [(torch.bfloat16, "window"), (torch.float32, "window")])
def test_cuda_memory_efficient_kernel_otherwise(dtype, mask):
    fn = _attention(dtype, mask)
    assert fn.name() == "ScaledDotProductEfficientAttentionBackward0"
    assert fn._saved_log_sumexp.dtype == torch.float32 and fn._saved_log_sumexp.shape[:2] == (2, 8)
    bias = fn._saved_attn_bias  # the boolean mask became an additive bias in the query's dtype, saved for backward
    assert bias.dtype == dtype and tuple(bias.shape)[-2:] == (128, 128)


def test_plan_traces_cuda_kernels_and_says_so(cli):
    args = ["plan", "--model", "tiny-gemma3", "--seq-len", "128", "--micro-batch", "1", "--precision", "bf16", "--trace", "--json"]
    r = cli(*args, "--kernels", "cuda")
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)["prediction"]["trace"]
    # three sliding-window layers send a mask (memory-efficient kernel), the global layer none (flash)
    assert t["kernels"] == "cuda" and t["attention_kernels"] == {"efficient": 3, "flash": 1}
    assert "CUDA attention kernels" in t["assumes"]
    r = cli(*args[:-2], "--kernels", "cuda", "--fast")
    assert r.returncode == 2 and "--fast traces nothing" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_zero2_partition_and_bucket_walk():
    numels = [100, 10, 50, 40]  # optimizer order; 200 elements over 2 ranks: rank 0 owns [0, 100), rank 1 [100, 200)
    assert owned(numels, 2, 0) == {0} and owned(numels, 2, 1) == {1, 2, 3}
    # DeepSpeed pads the flat group to a multiple of 2 x ranks: 10 elements -> 12, partitions [0, 6) and [6, 12);
    # the parameter across the boundary belongs to both (each copies it whole into its partition buffer)
    assert owned([5, 5], 2, 0) == {0, 1} and owned([5, 5], 2, 1) == {1}
    # backward arrives last-first: 40, 50 (oversized for a 45-element bucket), 10, then the tied 100
    arrivals = [[3, 40], [2, 50], [1, 10], [0, 100]]
    # rank 1: 50 does not fit beside 40 -> the bucket holding 40 (rank 1's) is reduced: partition from then on;
    # 50 stays alive until the next arrival reduces it, then 100 is held aside until the epilogue
    assert stage2_walk(arrivals, {1, 2, 3}, 45) == [(False, 0), (False, 0), (True, 50), (True, 0), (True, 100)]
    # rank 0 owns only the last arrival: its partition comes at the epilogue, after the walk
    assert [a for a, _ in stage2_walk(arrivals, {0}, 45)] == [False] * 5


def test_a_trace_scaled_in_depth_keeps_its_kernels():
    from transformers import LlamaConfig

    from hfscale.plan.peak import step_prediction

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2)
    p = step_prediction(config, 1, 64, "bf16", zero=2, engine="deepspeed", kernels="cuda")
    t = p["trace"]
    assert t["traced_layers"] == [2, 3]  # traced at 2 and 3 layers, scaled to 6
    assert t["kernels"] == "cuda" and t["attention_kernels"] == {"flash": 6} and "CUDA" in t["assumes"]
