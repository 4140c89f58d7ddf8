"""Measuring what the memory model predicts, exactly, on CPU.

`saved_activation_bytes` counts the bytes autograd saves for backward during one forward pass:
every tensor a saved-tensors hook sees, each storage once, parameters excluded. `SavedBytes` is the
same count around any forward (a sequence-parallel rank's, a ZeRO-3 engine's).
"""

from __future__ import annotations


class SavedBytes:
    """`with SavedBytes(model) as sb: forward...` then `sb.total`: bytes of the distinct storages saved for
    backward, parameters excluded (their storages are read at save time, so ZeRO-3's gathered weights count as
    parameters too)."""

    def __init__(self, model):
        self.params = list(model.parameters())
        self.seen: dict[int, int] = {}

    def _pack(self, t):
        import torch

        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.seen and not isinstance(t, torch.nn.Parameter):
            if ptr not in {p.untyped_storage().data_ptr() for p in self.params}:
                self.seen[ptr] = st.nbytes()
        return t

    def __enter__(self):
        import torch

        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def saved_activation_bytes(model, input_ids, labels=None) -> int:
    with SavedBytes(model) as sb:
        out = model(input_ids=input_ids, labels=labels if labels is not None else input_ids)
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    return sb.total
