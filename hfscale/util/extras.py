"""Optional dependencies: which extra brings which import, and the one line that says so.

`pip install hfscale` (core: torch, transformers, accelerate, datasets, peft, safetensors, pyyaml, tqdm,
tokenizers) runs `config`, `doctor`, `plan`, `tiny`, `slurm`, `eval`, `experts`, `prune`, the recipes
under DDP and `import hfscale` in a Trainer script. The rest needs an extra:

    [deepspeed]  deepspeed                          prove / profile / recipes under a DeepSpeed config
    [quant]      torchao, bitsandbytes              quantize --scheme, QAT (prepare_qat_, recipes/qat_clm.py)
    [edge]       gguf, executorch, llama-cpp-python quantize --format gguf|pte, bench
    [plot]       matplotlib                         plan --plot, profile's timeline.png
    [all]        all of the above

A verb that needs one checks before any work (`require`), and the CLI turns an import of a missing
extra that slipped past into the same line (`missing_extra_line`), exit 2:

    hfscale quantize --format gguf needs hfscale[edge]: pip install 'hfscale[edge]'
"""

from __future__ import annotations

import importlib.util

from .errors import HfscaleError

# extra -> the top-level import names it brings (pyproject.toml's [project.optional-dependencies] installs them)
EXTRAS: dict[str, tuple[str, ...]] = {
    "deepspeed": ("deepspeed",),
    "quant": ("torchao", "bitsandbytes"),
    "edge": ("gguf", "executorch", "llama_cpp", "torchao"),  # .pte's 8da4w is torchao's quantize_
    "plot": ("matplotlib",),
}
# import name -> the extra to name when it is missing (torchao: [quant], the smaller of the two that bring it)
EXTRA_OF: dict[str, str] = {}
for _extra, _mods in EXTRAS.items():
    for _m in _mods:
        EXTRA_OF.setdefault(_m, _extra)


class MissingExtra(HfscaleError):
    """A verb or function needs an optional dependency that is not installed."""


def installed(module: str) -> bool:
    """True when `module` can be imported (found without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def line(what: str, extra: str) -> str:
    return f"{what} needs hfscale[{extra}]: pip install 'hfscale[{extra}]'"


def require(what: str, extra: str, modules: tuple[str, ...] | None = None) -> None:
    """Raise MissingExtra (one line naming the pip command) unless every module of `extra` (or just
    `modules`) is importable. `what` names the verb as the user typed it ("hfscale quantize --format gguf")."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; one of {', '.join(EXTRAS)}")
    if any(not installed(m) for m in (modules or EXTRAS[extra])):
        raise MissingExtra(line(what, extra))


def missing_extra_line(err: ImportError, what: str) -> str | None:
    """The one line for an ImportError of a module an extra brings, else None (a real bug: let it raise)."""
    name = (getattr(err, "name", None) or "").split(".")[0]
    if name in EXTRA_OF and not installed(name):
        return line(what, EXTRA_OF[name])
    return None


def uses_deepspeed(accelerate_yaml) -> bool:
    """True when an accelerate YAML launches DeepSpeed (distributed_type DEEPSPEED or a deepspeed_config
    block). An unreadable file answers False: the caller's own checks report it."""
    import yaml

    try:
        with open(accelerate_yaml) as f:
            cfg = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return False
    if not isinstance(cfg, dict):
        return False
    return str(cfg.get("distributed_type", "")).upper() == "DEEPSPEED" or bool(cfg.get("deepspeed_config"))
