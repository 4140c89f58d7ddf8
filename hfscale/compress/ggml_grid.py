"""llama.cpp's Q4_0 grid in torch: quantize / dequantize bit-exactly as ggml does, and a QAT
fake-quantizer on that grid, so a model trained against it exports to Q4_0 GGUF unchanged.

ggml's rule (`quantize_row_q4_0_ref` in ggml-quants.c; `gguf.quants.Q4_0` in Python), per block of
32 consecutive weights along a row (the input dimension of an nn.Linear weight [out, in]):

    max = the element with the largest |x| (the first one on ties), *with its sign*
    d   = max / -8                      (fp32; stored as fp16)
    id  = 1 / d  (0 when d == 0)        (fp32, from the fp32 d, not the fp16 one)
    q   = min(15, trunc(x * id + 8.5))  (4 bits, 0..15; trunc == floor here since x*id >= -8)
    x'  = (q - 8) * fp16(d)

So the extreme element always lands on q = 0 (x' = -8·d), the grid is asymmetric (-8..7), and
"round half up" comes from trunc(· + 8.5). Re-quantizing x' reproduces it exactly: its extreme
is -8·fp16(d), whose d is fp16(d) itself, and x'·id lies within 2^-23 of an integer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QK4_0 = 32


def _blocks(w: torch.Tensor) -> torch.Tensor:
    if w.shape[-1] % QK4_0:
        raise ValueError(f"Q4_0 needs rows that are a multiple of {QK4_0} (got {w.shape[-1]}); "
                         "keep this tensor in F16/Q8_0 or pad the layer")
    return w.detach().to(torch.float32).reshape(-1, QK4_0)


def q4_0_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d as fp16 [n_blocks], q as uint8 0..15 [n_blocks, 32]) exactly as ggml computes them."""
    b = _blocks(w)
    imax = b.abs().argmax(dim=-1, keepdim=True)  # first maximal index, like ggml's strict '<'
    mx = torch.gather(b, -1, imax)
    d = mx / -8.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.trunc(b * inv + 8.5).clamp_(0, 15).to(torch.uint8)
    return d.squeeze(-1).to(torch.float16), q


def q4_0_dequantize(d: torch.Tensor, q: torch.Tensor, shape) -> torch.Tensor:
    """fp32 weights from (d, q): (q - 8) * d, the values llama.cpp computes with."""
    return ((q.to(torch.float32) - 8.0) * d.to(torch.float32).unsqueeze(-1)).reshape(shape)


def q4_0_round_trip(w: torch.Tensor) -> torch.Tensor:
    """The weights llama.cpp will use for `w` after a Q4_0 export (fp32, same shape)."""
    d, q = q4_0_quantize(w)
    return q4_0_dequantize(d, q, w.shape)


def q4_0_pack(w: torch.Tensor) -> bytes:
    """ggml's block_q4_0 bytes (fp16 d, then 16 bytes: low nibble j, high nibble j + 16)."""
    d, q = q4_0_quantize(w)
    qs = q[:, :16] | (q[:, 16:] << 4)
    return torch.cat([d.view(torch.uint8).reshape(-1, 2), qs], dim=1).numpy().tobytes()


class _STE(torch.autograd.Function):
    """Forward: the Q4_0 grid value. Backward: identity (straight-through estimator)."""

    @staticmethod
    def forward(ctx, w):
        return q4_0_round_trip(w).to(w.dtype)

    @staticmethod
    def backward(ctx, g):
        return g


def fake_q4_0(w: torch.Tensor) -> torch.Tensor:
    return _STE.apply(w)


class _Q4_0Linear(nn.Linear):
    def forward(self, x):
        return F.linear(x, fake_q4_0(self.weight), self.bias)


def _embedding_forward(self, input_ids):
    out = F.embedding(input_ids, fake_q4_0(self.weight), self.padding_idx)
    scale = getattr(self, "embed_scale", None)  # Gemma scales embeddings by sqrt(hidden)
    return out if scale is None else out * scale.to(out.dtype)


_ORIG = "_hfscale_q4_0_orig_class"


def _swap(module: nn.Module, forward) -> None:
    cls = type(module)
    setattr(module, _ORIG, cls)
    module.__class__ = type(f"Q4_0QAT{cls.__name__}", (cls,), {"forward": forward})


def _input_embedding(model: nn.Module):
    get = getattr(model, "get_input_embeddings", None)
    return get() if get is not None else None


def prepare_q4_0_qat_(model: nn.Module, include_embeddings: bool = False) -> nn.Module:
    """Fake-quantize every nn.Linear weight on llama.cpp's Q4_0 grid in forward (in place).

    The weight Parameters stay the same objects, so optimizers and tied weights keep working.
    A Linear whose weight *is* the input embedding (Gemma's tied lm_head) follows
    `include_embeddings`: the GGUF writer keeps the token embedding at Q8_0/F16 by default, so
    training it against Q4_0 would aim at the wrong grid.
    """
    emb = _input_embedding(model)
    emb_w = emb.weight if emb is not None else None
    n = 0
    for m in model.modules():
        if hasattr(m, _ORIG):
            raise ValueError("model is already prepared for Q4_0 QAT; call convert_q4_0_ first")
        if isinstance(m, nn.Linear):
            if m.weight is emb_w and not include_embeddings:
                continue
            if m.in_features % QK4_0:
                continue  # ggml cannot store it as Q4_0; the writer keeps it at higher precision
            _swap(m, _Q4_0Linear.forward)
            n += 1
    if include_embeddings and emb is not None and emb.weight.shape[-1] % QK4_0 == 0:
        _swap(emb, _embedding_forward)
        n += 1
    if n == 0:
        raise ValueError("no nn.Linear with in_features divisible by 32 found; nothing to train for Q4_0")
    return model


@torch.no_grad()
def convert_q4_0_(model: nn.Module) -> nn.Module:
    """Remove the fake-quantizers and snap each prepared weight to its Q4_0 grid value (in place).

    The modules become their original classes again (plain nn.Linear), so the model saves as
    ordinary safetensors and a Q4_0 GGUF export reproduces these fp32 values bit for bit.
    """
    done = set()
    for m in model.modules():
        cls = getattr(m, _ORIG, None)
        if cls is None:
            continue
        if id(m.weight) not in done:  # a tied weight is snapped once
            m.weight.copy_(q4_0_round_trip(m.weight).to(m.weight.dtype))
            done.add(id(m.weight))
        m.__class__ = cls
        delattr(m, _ORIG)
    if not done:
        raise ValueError("model was not prepared with prepare_q4_0_qat_; nothing to convert")
    return model
