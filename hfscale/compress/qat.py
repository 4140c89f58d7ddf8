"""Quantization-aware training: prepare (fake-quantize for a scheme) -> train -> convert.

During training every selected nn.Linear computes with its weights (and, for 8da4w, its input
activations) rounded to the scheme's grid in forward, while gradients flow straight through to
the float weights; the model learns weights that survive the rounding. Convert then applies the
real quantization - the same grid - so the saved model computes exactly what training saw.

    from hfscale.compress.qat import prepare_qat_, convert_qat_
    prepare_qat_(model, "8da4w")            # before building the optimizer (parameters stay the same objects)
    ... train as usual (plain loop, accelerate, Trainer + QATCallback) ...
    convert_qat_(model, "8da4w")            # real int4 weights; save with compress.save.save_model_dir

torchao schemes go through torchao's own `QATConfig(base, step="prepare"|"convert")`, whose fake
quantizers are built from the same base config as PTQ; `q4_0` uses hfscale.compress.ggml_grid, whose
fake quantizer is llama.cpp's Q4_0 grid bit for bit (a Q4_0 GGUF export then holds exactly the
trained weights). Options: LoRA adapters on the fake-quantized base (peft; merged before convert)
and distillation from the unquantized model (Gemma 3's QAT trained on the teacher's probabilities).
"""

from __future__ import annotations

from ..util.errors import ConfigError
from .schemes import QAT_SCHEMES, QuantSpec, linear_filter, torchao_linear_config, transformers_config

def as_spec(scheme) -> QuantSpec:
    spec = scheme if isinstance(scheme, QuantSpec) else QuantSpec(str(scheme))
    if spec.scheme not in QAT_SCHEMES:
        raise ConfigError(f"scheme {spec.scheme} has no QAT form; choose one of {', '.join(QAT_SCHEMES)}")
    return spec


def is_prepared(model) -> bool:
    from .ggml_grid import _ORIG

    return any(type(m).__name__.startswith("FakeQuantized") or hasattr(m, _ORIG) for m in model.modules())


def prepare_qat_(model, scheme):
    """Swap the selected linears for fake-quantized ones, in place. Parameters stay the same tensors."""
    spec = as_spec(scheme)
    if is_prepared(model):
        raise ConfigError("model is already prepared for QAT; call convert_qat_ first")
    if spec.scheme == "q4_0":
        from .ggml_grid import prepare_q4_0_qat_

        return prepare_q4_0_qat_(model, include_embeddings=spec.include_embeddings)
    from ..util.extras import require

    require(f"prepare_qat_(model, {spec.scheme!r})", "quant", ("torchao",))
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    quantize_(model, QATConfig(torchao_linear_config(spec), step="prepare"), filter_fn=linear_filter(False))
    return model


def convert_qat_(model, scheme):
    """Replace the fake quantizers by the real quantization (in place) and make the model saveable."""
    spec = as_spec(scheme)
    if not is_prepared(model):
        raise ConfigError("model was not prepared for QAT (prepare_qat_); for plain quantization use hfscale quantize")
    if spec.scheme == "q4_0":
        from .ggml_grid import convert_q4_0_

        return convert_q4_0_(model)  # float weights snapped to the Q4_0 grid; export with --format gguf --qtype Q4_0
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    from .save import attach_torchao_quantizer

    quantize_(model, QATConfig(torchao_linear_config(spec), step="convert"), filter_fn=linear_filter(False))
    attach_torchao_quantizer(model, transformers_config(spec))
    return model


def lora_spec(rank: int, alpha: int | None = None, dropout: float = 0.0):
    """The LoRA QAT trains on the (fake-quantized) decoder linears: hfscale.scale.adapters.AdapterSpec("lora", rank,
    alpha, dropout), the one LoRA home (recipes/qat_clm.py applies it through hfscale.train.prepare)."""
    from ..scale.adapters import AdapterSpec

    if rank < 1:
        raise ConfigError(f"lora rank must be >= 1 (got {rank}); use 0 to train the full model")
    return AdapterSpec("lora", rank=rank, alpha=alpha, dropout=dropout)


def add_lora_(model, rank: int, alpha: int | None = None, dropout: float = 0.0):
    """LoRA adapters on the (fake-quantized) decoder linears; only the adapters train. Returns the PeftModel."""
    from ..scale.adapters import apply_adapter

    return apply_adapter(model, lora_spec(rank, alpha, dropout))


def merge_lora(model):
    """Fold the adapters into the base weights (which the convert step then quantizes)."""
    from ..scale.adapters import merge_live

    return merge_live(model)


def distillation_loss(student_logits, teacher_logits, labels, weight: float, temperature: float = 1.0,
                      denominator=None):
    """(1 - weight) x next-token CE on the data + weight x T^2 x KL(teacher || student) per token, both summed
    over the trained positions only (labels[:, t + 1] != -100: the contract of hfscale.models.documents; full
    blocks whose labels are their inputs train every next token) and divided by `denominator` (the step's
    trained-token count, hfscale.models.loss) or, without one, by this batch's count (its per-token mean).

    weight=1 trains on the teacher's probabilities alone (Gemma 3's QAT recipe); 0 is plain CE.
    """
    import torch.nn.functional as F

    from ..models.loss import token_nll

    nll, count = token_nll(student_logits, labels)
    n = count if denominator is None else denominator
    ce = nll / n
    if weight == 0:
        return ce
    trained = (labels[:, 1:] != -100).unsqueeze(-1)
    s = student_logits[:, :-1].float()
    t = teacher_logits[:, :-1].float()
    kl = F.kl_div(F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1), log_target=True,
                  reduction="none")
    kl = kl.masked_fill(~trained, 0.0).sum() / n
    return (1 - weight) * ce + weight * temperature**2 * kl


def _trainer_callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class QATCallback(_trainer_callback_base()):
    """HF Trainer integration: fake-quantize at train start, convert (and optionally save) at train end.

        trainer = Trainer(model, args, ..., callbacks=[QATCallback("8da4w", save_dir="out/quantized")])
        trainer.train()        # trains against the int4 grid; ends with real int4 weights

    Preparing keeps the weight Parameters, so the optimizer Trainer already built stays valid.
    """

    def __init__(self, scheme, save_dir: str | None = None, tokenizer=None, convert: bool = True):
        self.spec = as_spec(scheme)
        self.save_dir, self.tokenizer, self.convert = save_dir, tokenizer, convert

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not is_prepared(model):
            prepare_qat_(model, self.spec)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not self.convert:
            return
        convert_qat_(model, self.spec)
        if self.save_dir and state.is_world_process_zero:
            from .save import save_model_dir

            save_model_dir(model, self.save_dir, tokenizer=self.tokenizer, force=True)
