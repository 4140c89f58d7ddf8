"""Which attention kernel a step runs on, for the fake-tensor trace: what a CUDA run saves, on a CPU host.

CPU and CUDA run the same transformers code up to `torch.nn.functional.scaled_dot_product_attention`;
inside it, the device picks a kernel and the kernel's autograd formula decides what is saved for
backward. A CPU-only torch cannot build fake CUDA tensors that take part in autograd (measured with torch
2.13: the process aborts, "not linked with support for cuda devices"), but the CUDA kernels' own fake
implementations (their meta kernels: output shapes, dtypes, and the autograd node that saves what the
derivative needs) run on fake CPU tensors. `cuda_attention()` routes sdpa to those ops the way torch's
CUDA dispatcher (`sdp_utils`) picks them on A100 / H100 (sm80 / sm90):

  flash (`_scaled_dot_product_flash_attention`): fp16 / bf16, no attention mask (causal or none), query,
      key and value head size <= 256 (torch pads it to a multiple of 8), grouped K/V heads passed as they
      are. Saves q, k, v, the output and the log-sum-exp (B x H x S, fp32) - no S x S probabilities.
  math (`_scaled_dot_product_attention_math`): grouped K/V heads (`enable_gqa`, which transformers sets only
      without a mask) that flash cannot take, e.g. fp32: torch documents GQA for the flash and math kernels
      only on CUDA. Composite: autograd saves the S x S probabilities.
  memory-efficient (`_scaled_dot_product_efficient_attention`): everything else the model sends (a mask,
      e.g. a sliding window, fp32, head sizes over 256), the mask as an additive bias. Saves q, k, v, the
      bias, the output and the log-sum-exp.
  cuDNN attention (preferred on H100 by some torch releases) saves the same tensors as flash; it is not
      chosen here. Other GPUs (e.g. sm86 / sm89 limits on flash head sizes with gradients) are not modelled.

The CPU trace (`kernels="cpu"`) is checked against real CPU runs to the byte; the CUDA variant's saved
tensors follow from these ops' registered formulas and have not been compared with a GPU run (none was
available): `benchmarks/gpu_peak.py` does that when a GPU is lent.
"""

from __future__ import annotations

import contextlib
from collections import Counter

KERNELS = ("cpu", "cuda")


def cuda_kernel(query, key, value, attn_mask, enable_gqa: bool = False) -> str:
    """The kernel CUDA's sdpa dispatcher takes for these inputs (see the module docstring)."""
    import torch

    half = query.dtype in (torch.float16, torch.bfloat16)
    if half and attn_mask is None and max(query.shape[-1], key.shape[-1], value.shape[-1]) <= 256:
        return "flash"
    if enable_gqa and key.shape[1] != query.shape[1]:
        return "math"
    return "efficient"


@contextlib.contextmanager
def cuda_attention(counts: Counter | None = None):
    """Within this context, `F.scaled_dot_product_attention` runs CUDA's kernels' fake implementations
    (on fake tensors only: real CPU tensors would hit CUDA-only kernels). `counts` tallies the kernels."""
    import torch
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    aten = torch.ops.aten

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if torch.is_autocast_enabled("cpu"):  # the trace's autocast stands for CUDA's: sdpa runs in its dtype
            dt = torch.get_autocast_dtype("cpu")
            query, key, value = query.to(dt), key.to(dt), value.to(dt)
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(dt)
        kernel = cuda_kernel(query, key, value, attn_mask, enable_gqa)
        if counts is not None:
            counts[kernel] += 1
        if kernel == "flash":
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
        if kernel == "math":
            return aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal,
                                                           scale=scale, enable_gqa=enable_gqa)[0]
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill(~bias, float("-inf"))
        need_lse = query.requires_grad or key.requires_grad or value.requires_grad
        return aten._scaled_dot_product_efficient_attention(query, key, value, bias, need_lse, dropout_p, is_causal,
                                                            scale=scale)[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield counts
    finally:
        F.scaled_dot_product_attention = original


__all__ = ["KERNELS", "cuda_attention", "cuda_kernel"]
