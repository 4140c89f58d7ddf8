"""Writing a quantized model as a transformers directory (safetensors) that `from_pretrained` reloads
with the same logits, atomically (hfscale.util.atomic.staged: a stage beside the target + rename).

Measured pitfall (torchao 0.18 on CPU; pytorch/ao #3800, #2230): `save_pretrained` on a model quantized in memory
with `quantize_` (PTQ, QAT convert, GPTQ) fails with "Attempted to access the data pointer on an invalid
python storage" - transformers only flattens torchao tensor subclasses into plain tensors + metadata
when the model carries a torchao quantizer, which only `from_pretrained(quantization_config=...)`
attaches. So we attach the same quantizer `from_pretrained` would have: the model then saves exactly
like one loaded with TorchAoConfig, and its config.json records the quantization for the reload.
"""

from __future__ import annotations

from pathlib import Path

from ..util.atomic import check_writable, staged
from ..util.errors import HfscaleError


def dir_bytes(path: str | Path) -> int:
    """Bytes of the weight files in a transformers directory (what a download or a disk holds)."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def attach_torchao_quantizer(model, transformers_cfg) -> None:
    """Make a `quantize_`-d model save like one loaded with `quantization_config=transformers_cfg`."""
    from transformers.quantizers.quantizer_torchao import TorchAoHfQuantizer

    model.config.quantization_config = transformers_cfg
    model.hf_quantizer = TorchAoHfQuantizer(transformers_cfg)
    model.is_quantized = True


def save_model_dir(model, out: str | Path, tokenizer=None, force: bool = False, extra_files: dict | None = None) -> Path:
    """save_pretrained(safe_serialization=True) into a stage beside `out`, then rename it into place.

    Refuses before writing if `out` exists and force is off; a crash leaves `out` as it was.
    """
    out = Path(out)
    check_writable({out: "--out"}, force)
    if any(getattr(getattr(p, "quant_state", None), "packing_format_for_cpu", False) for p in model.parameters()):
        raise HfscaleError("this bitsandbytes 4-bit model ran forward on CPU in its repacked layout, which does not save "
                           "back correctly; load it with hfscale.compress.ptq.quantize_model (portable layout) and save it first")
    with staged(out, directory=True) as tmp:  # the directory appears whole or not at all
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return out


def differing_tensors(a, b) -> int:
    """How many of the state's plain tensors (a quantized tensor's int data, scales and zero points each count, and
    its metadata: class, block size, layout, shape, dtype) are not bit for bit equal between the two models, or
    missing from one: what the save must preserve. The logits
    are reported beside it, but with dynamic activation quantization (8da4w) they are not a bitwise test: the GEMM
    on a reloaded (differently aligned) copy can differ in the last float bit, which may flip one int8 activation
    rounding and move a logit by ~1e-3 (5.8e-3 seen on a CI host, 0.0 here)."""
    from ..scale.adapters import same_bits
    from .ptq import plain_parts

    def flat(model) -> dict:
        return {k: v for name, t in model.state_dict().items() for k, v in plain_parts(name, t)}

    fa, fb = flat(a), flat(b)
    differ = len(fa.keys() ^ fb.keys())
    for k in fa.keys() & fb.keys():
        x, y = fa[k], fb[k]
        if isinstance(x, str) or isinstance(y, str):
            differ += x != y
        elif not same_bits(x, y):
            differ += 1
    return differ

