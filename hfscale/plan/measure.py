"""Measuring what the memory model predicts, exactly, on CPU.

`saved_activation_bytes` counts the bytes autograd saves for backward during one forward pass:
every tensor a saved-tensors hook sees, each storage once, parameters excluded.
"""

from __future__ import annotations


def saved_activation_bytes(model, input_ids, labels=None) -> int:
    import torch

    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in param_ptrs and ptr not in seen:
            seen[ptr] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=input_ids, labels=labels if labels is not None else input_ids)
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())
