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

from .util.errors import ConfigError, HfscaleError  # noqa: E402

# name -> module; imported on first use so `import hfscale` stays light (no torch)
_LAZY = {
    "ScaleSpec": ".scale.spec", "Zero": ".scale.spec", "Launch": ".scale.spec", "Aio": ".scale.spec",
    "preset": ".scale.presets", "PRESETS": ".scale.presets",
    "to_deepspeed": ".scale.deepspeed", "to_accelerate": ".scale.accelerate",
    "make_accelerator": ".scale.runtime", "make_optimizer": ".scale.runtime", "training_arguments_kwargs": ".scale.runtime",
    "exit_rank": ".scale.runtime",
    "load_spec": ".scale.load", "write_config_sets": ".scale.files", "to_training_arguments": ".scale.trainer",
    "prepare_qat_": ".compress.qat", "convert_qat_": ".compress.qat", "QATCallback": ".compress.qat",
    "QuantSpec": ".compress.schemes", "SCHEMES": ".compress.schemes",
}
# public subpackages and modules: name -> where it lives
_SUBMODULES = {"doctor": ".doctor", "plan": ".plan", "scale": ".scale", "compress": ".compress", "export": ".export",
               "train": ".train", "experts": ".experts", "models": ".models", "corpus": ".data.corpus", "data": ".data",
               "proof": ".proofs.engine"}

# Modules that lived at other paths before the layout of 0.1 (util/, models/, proofs/, testing/): the old
# dotted paths keep importing the same module objects (`from hfscale.models import build_model` still works).
_MOVED = {
    "atomic": "util.atomic", "cache": "util.cache", "errors": "util.errors", "quiet": "util.quiet",
    "extras": "util.extras", "hosts": "util.hosts", "corpus": "data.corpus", "models.corpus": "data.corpus",
    "train.batching": "data.sampler", "plan.dims": "models.dims",
    "proof": "proofs.engine", "parallel_proof": "proofs.parallel", "profile": "proofs.profile",
    "demo": "proofs.demo", "checkpointing": "scale.checkpointing", "slurm": "scale.slurm",
    "pretrained": "testing.trained", "plan.zoo": "testing.zoo", "experts.tiny": "testing.tiny_moe",
}

__all__ = ["ConfigError", "HfscaleError", "__version__", *_LAZY, *_SUBMODULES]


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name], __name__)
    raise AttributeError(f"module 'hfscale' has no attribute {name!r}")


class _MovedModules:
    """A meta path finder: `hfscale.<old path>` imports as the module now at `hfscale.<new path>` (_MOVED)."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        import importlib.util

        prefix = __name__ + "."
        if fullname.startswith(prefix) and fullname[len(prefix):] in _MOVED:
            return importlib.util.spec_from_loader(fullname, _MovedModules)
        return None

    @staticmethod
    def create_module(spec):
        import importlib

        return importlib.import_module(f"{__name__}.{_MOVED[spec.name[len(__name__) + 1:]]}")

    @staticmethod
    def exec_module(module):
        pass


if not any(isinstance(f, type) and f.__name__ == "_MovedModules" for f in __import__("sys").meta_path):
    __import__("sys").meta_path.append(_MovedModules)
