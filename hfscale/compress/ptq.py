"""Post-training quantization: a model (built-in name, local dir, hub name) -> a quantized model in memory,
ready for `save.save_model_dir` and for `evaluate`.

torchao and bitsandbytes schemes load through `from_pretrained(..., quantization_config=...)`, the
route transformers itself supports for saving and reloading. The calibrated scheme (gptq-int4wo)
quantizes in memory from calibration batches and then carries the same torchao quantizer.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from ..util.errors import HfscaleError
from .schemes import QuantSpec, require_device, transformers_config


@contextlib.contextmanager
def source_dir(model: str):
    """A transformers directory for `model`: itself, or a temp copy of a built-in model's seeded weights."""
    from ..models.builtin import is_builtin, save_pretrained_dir

    if not is_builtin(model):
        yield model
        return
    tmp = Path(tempfile.mkdtemp(prefix="hfscale-src-"))
    try:
        yield str(save_pretrained_dir(model, tmp / "model"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_float(src: str, dtype=None):
    from ..models.builtin import build_model

    model = build_model(src, dtype=dtype)
    return model.eval()


def quantize_model(src: str, spec: QuantSpec, calibration=None, dtype=None, progress: bool = True):
    """The quantized model for directory/hub name `src`. `calibration`: int64 [n, seq] token blocks
    (required by calibrated schemes, ignored by the others)."""
    import torch
    from transformers import AutoModelForCausalLM

    require_device(spec.scheme)
    if spec.scheme == "q4_0":
        raise HfscaleError("q4_0 is a QAT grid (recipes/qat_clm.py --scheme q4_0); for a Q4_0 file use hfscale quantize --format gguf --qtype Q4_0")
    if spec.info.calibrated:
        if calibration is None:
            raise HfscaleError(f"{spec.scheme} needs calibration data; pass --calibration builtin or a text file")
        from .gptq import gptq_quantize_
        from .save import attach_torchao_quantizer

        model = load_float(src, dtype=dtype)
        gptq_quantize_(model, spec, calibration, progress=progress)
        attach_torchao_quantizer(model, transformers_config(spec))
        return model
    kwargs = {}
    if spec.info.library == "bitsandbytes":
        kwargs["device_map"] = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model = AutoModelForCausalLM.from_pretrained(src, quantization_config=transformers_config(spec), dtype=dtype,
                                                     use_safetensors=True, trust_remote_code=False, **kwargs)
    except (OSError, ValueError) as e:
        from ..models.builtin import _not_found

        raise HfscaleError(_not_found(src, e)) from None
    if spec.info.library == "bitsandbytes":
        from ..scale.adapters import keep_bnb_layout_

        keep_bnb_layout_(model)
    return model.eval()


def quantized_bytes_in_memory(model) -> int:
    """Bytes the weights occupy in memory (quantized tensors count their int data and scales)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += sum(x.numel() * x.element_size() for _, x in plain_parts("", t) if not isinstance(x, str))
    return total


def plain_parts(name: str, t):
    """(name, plain tensor) for each tensor inside a quantized tensor subclass (int data, scales, zero points,
    recursively), then (name + ".<meta>", its metadata as text); a plain tensor is its own single part. The one walk
    over torchao's subclasses: memory counting here, the save's bit-for-bit check (compress.save.differing_tensors)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        yield name, t
        return
    inners, meta = t.__tensor_flatten__()
    for inner in inners:
        if getattr(t, inner) is not None:
            yield from plain_parts(f"{name}.{inner}", getattr(t, inner))
    # grid, layout, shape (a reload gives lists where the quantizer made tuples: the same grid)
    yield f"{name}.<meta>", f"{type(t).__name__} {_plain(meta)!r} {tuple(t.shape)} {t.dtype}"


def _plain(meta):
    """Metadata with lists as tuples, recursively (what a reload reads back as JSON lists)."""
    if isinstance(meta, dict):
        return {k: _plain(v) for k, v in meta.items()}
    if isinstance(meta, (list, tuple)):
        return tuple(_plain(v) for v in meta)
    return meta


def ptq_in_memory(src: str, spec: QuantSpec, calibration=None):
    """PTQ of `src` for the quality table. q4_0 (a QAT grid, not a torchao scheme) is llama.cpp's
    round trip of the float weights: what a Q4_0 GGUF export of the untrained-for-it model computes."""
    if spec.scheme != "q4_0":
        return quantize_model(src, spec, calibration=calibration, progress=False)
    from .qat import convert_qat_, prepare_qat_

    return convert_qat_(prepare_qat_(load_float(src), spec), spec)
