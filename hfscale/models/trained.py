"""The trained embedded default: the built-in tiny Gemma 3 after 300 steps on the built-in corpus, shipped in
hfscale/models/data/trained/ (bf16 safetensors, 6.0 MB; made by tools/build_trained_tiny.py in 319 s on a 2-core
AVX512 host, held-out perplexity 135 on the first 64 validation blocks). The demo and every fixture that needs
"a model that has learnt something" start from it instead of training one.

`trained_default()` gives it as a transformers directory (fp32 weights + the built-in tokenizer) in the cache,
copied once; the shipped files themselves are never written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SHIPPED_FILES = ("config.json", "hfscale_training.json", "model.safetensors")
NAME = "tiny-gemma3-trained"  # the cache entry: NAME-<recipe key> (hfscale.testing.trained trains other recipes there)


def shipped_dir() -> Path:
    from importlib import resources

    return Path(str(resources.files("hfscale.models") / "data" / "trained"))


def shipped_info() -> dict | None:
    """The shipped hfscale_training.json (recipe, its key, losses, host), or None when the files are incomplete."""
    d = shipped_dir()
    try:
        info = json.loads((d / "hfscale_training.json").read_text())
    except (OSError, ValueError):
        return None
    return info if all((d / f).is_file() for f in SHIPPED_FILES) and "recipe_key" in info else None


def copy_shipped(out: Path, src: Path | None = None) -> None:
    """The shipped weights as an fp32 transformers directory with the tokenizer (what training would leave)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from .builtin import TINY, load_tokenizer

    src = src or shipped_dir()
    weights = {k: v.to(torch.float32) for k, v in load_file(src / "model.safetensors").items()}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    load_tokenizer(TINY).save_pretrained(out)
    shutil.copyfile(src / "hfscale_training.json", out / "hfscale_training.json")


def trained_default(cache: str | os.PathLike | None = None) -> Path:
    """Path of the shipped trained tiny Gemma 3 as an fp32 transformers directory under $HFSCALE_CACHE (or `cache`)."""
    from ..util.cache import cached_dir
    from ..util.errors import HfscaleError

    info = shipped_info()
    if info is None:
        raise HfscaleError(f"the trained tiny model is missing from {shipped_dir()}: reinstall hfscale or run "
                           "tools/build_trained_tiny.py from a checkout")
    return cached_dir(NAME, info["recipe_key"], copy_shipped, "hfscale_training.json", cache)
