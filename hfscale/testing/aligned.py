"""Models whose logits can be compared bit for bit on any CPU.

transformers' `from_pretrained` leaves fp32 weights as views into the memory-mapped safetensors file, at offsets
that are only 4-byte aligned (28 mod 64 for the tiny models here), while a model built in memory or loaded with
`load_state_dict` holds fresh, 64-byte aligned allocations. MKL's fp32 gemv (one row: a one-token decode, one
row per routed expert) rounds differently with the alignment on its SSE / AVX code paths, the ones it takes on
AMD hosts: the same weights give logits 7.7e-7 apart (reproduced on an Intel host with
MKL_ENABLE_INSTRUCTIONS=SSE4_2; with its AVX2 / AVX512 paths the results agree). A test that asserts
bit-identity between two models therefore gives both the same alignment first: then both run the same kernel
on the same bytes on every host, and equality tests our arithmetic rather than the CPU.
"""

from __future__ import annotations


def own_weights_(model):
    """Move every parameter and buffer of `model` to a fresh allocation (64-byte aligned, like any tensor
    torch allocates); returns the model."""
    for t in [*model.parameters(), *model.buffers()]:
        t.data = t.data.clone()
    return model


def load_owned(path, **kwargs):
    """`AutoModelForCausalLM.from_pretrained(path, **kwargs)` in eval mode with its weights owned (see above)."""
    from transformers import AutoModelForCausalLM

    return own_weights_(AutoModelForCausalLM.from_pretrained(path, **kwargs).eval())
