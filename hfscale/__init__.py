"""hfscale: scale configs, planning, pre-flight checks, compression and edge export for HF models.

For existing training code:

    import hfscale
    accelerator = hfscale.make_accelerator(gradient_accumulation_steps=4)        # right on GPU and CPU hosts
    args = TrainingArguments("out", **hfscale.training_arguments_kwargs(hfscale.preset("zero3")))
    ...; hfscale.exit_rank(0)        # a launched script's last line: no teardown race at exit (docs/checkpoints.md)
    ds_dict = hfscale.to_deepspeed(hfscale.preset("zero2"))
    findings = hfscale.doctor.check(accelerate="accelerate_configs/zero3.yaml")
    hfscale.prepare_qat_(model, "8da4w"); ...train...; hfscale.convert_qat_(model, "8da4w")   # or QATCallback
"""

__version__ = "0.1.0"

from .errors import ConfigError, HfscaleError  # noqa: E402

# name -> module; imported on first use so `import hfscale` stays light (no torch)
_LAZY = {
    "ScaleSpec": ".scale.spec", "Zero": ".scale.spec", "Launch": ".scale.spec", "Aio": ".scale.spec",
    "preset": ".scale.presets", "PRESETS": ".scale.presets",
    "to_deepspeed": ".scale.deepspeed", "to_accelerate": ".scale.accelerate",
    "make_accelerator": ".scale.runtime", "make_optimizer": ".scale.runtime", "training_arguments_kwargs": ".scale.runtime",
    "exit_rank": ".scale.runtime",
    "load_spec": ".scale.load", "write_config_sets": ".scale.files",
    "prepare_qat_": ".compress.qat", "convert_qat_": ".compress.qat", "QATCallback": ".compress.qat",
    "QuantSpec": ".compress.schemes", "SCHEMES": ".compress.schemes",
}
_SUBMODULES = {"doctor", "plan", "models", "corpus", "proof", "scale", "compress", "export", "train"}

__all__ = ["ConfigError", "HfscaleError", "__version__", *_LAZY, *_SUBMODULES]


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'hfscale' has no attribute {name!r}")
