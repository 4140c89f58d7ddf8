"""Test support (tests and benchmarks; not used by the package itself). A trained copy of the built-in tiny Gemma 3, for everything that needs a model that has learnt
something: quantization quality (PTQ vs QAT), export checks (GGUF, .pte), evaluation.

A random-init model makes quality numbers meaningless (every scheme is "equally bad"), so this
trains the tiny model on the built-in corpus with a plain single-process loop — deterministic for
a given (steps, seq_len, batch, lr, seed) and host — and caches the result as a transformers directory
(safetensors + tokenizer) under $HFSCALE_CACHE (default ~/.cache/hfscale). Cluster training
goes through recipes/train_clm.py; this is a fixed, small fixture.

The default recipe's result ships in hfscale/models/data/trained/ (bf16 weights, made by
tools/build_trained_tiny.py): `trained_tiny()` copies it (as fp32) instead of training, so a fresh test run
spends no time on it and every host tests the same weights. Other recipes are trained here.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ..util.cache import cache_root


@dataclass(frozen=True)
class TinyTraining:
    steps: int = 300
    seq_len: int = 128
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 20
    seed: int = 0

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]




SHIPPED_FILES = ("config.json", "hfscale_training.json", "model.safetensors")


def shipped_dir() -> Path:
    from importlib import resources

    return Path(str(resources.files("hfscale.models") / "data" / "trained"))


def _shipped(recipe: TinyTraining) -> Path | None:
    """The shipped directory if it holds `recipe`'s result (its recorded recipe key), else None."""
    d = shipped_dir()
    try:
        info = json.loads((d / "hfscale_training.json").read_text())
    except (OSError, ValueError):
        return None
    return d if info.get("recipe_key") == recipe.key() and all((d / f).is_file() for f in SHIPPED_FILES) else None


def cached_dir(name: str, key: str, build, done: str, cache: str | os.PathLike | None = None) -> Path:
    """`root/name-key`, built once by `build(staging_dir)` (it appears whole or not at all: a concurrent builder's
    equal copy may be replaced) and reused while its `done` file exists. The one cache for trained fixtures."""
    from ..util.atomic import staged

    out = (Path(cache) if cache is not None else cache_root()) / f"{name}-{key}"
    if not (out / done).is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with staged(out, directory=True) as tmp:
            build(tmp)
    return out


def fit(model, next_batch, steps: int, lr: float, schedule=None, clip: float | None = None, desc: str | None = None,
        progress: bool = False) -> list[float]:
    """The fixtures' training loop: AdamW (no weight decay) on `next_batch(step)` for `steps` steps, with an
    optional LambdaLR `schedule` and gradient clipping; the model is left in eval mode. Returns the losses."""
    import torch
    from tqdm.auto import tqdm

    from ..models.loss import lm_loss

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule else None
    model.train()
    losses = []
    for step in tqdm(range(steps), desc=desc, disable=not progress):
        batch = next_batch(step)
        loss = lm_loss(model, batch)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched:
            sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


def trained_tiny(recipe: TinyTraining = TinyTraining(), cache: str | os.PathLike | None = None,
                 progress: bool = True) -> Path:
    """Path of a transformers directory holding the tiny model trained per `recipe` (built once)."""

    shipped = _shipped(recipe)

    def build(tmp: Path) -> None:
        if shipped is not None:
            _copy_shipped(shipped, tmp)
            return
        info = _train(recipe, tmp, progress)
        (tmp / "hfscale_training.json").write_text(json.dumps(info, indent=2) + "\n")

    return cached_dir("tiny-gemma3-trained", recipe.key(), build, "hfscale_training.json", cache)


def _copy_shipped(src: Path, out: Path) -> None:
    """The shipped weights as an fp32 transformers directory with the tokenizer (what training would leave)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from ..models.builtin import TINY, load_tokenizer

    weights = {k: v.to(torch.float32) for k, v in load_file(src / "model.safetensors").items()}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    load_tokenizer(TINY).save_pretrained(out)
    shutil.copyfile(src / "hfscale_training.json", out / "hfscale_training.json")


def val_loss(model_or_dir, seq_len: int = 128, blocks: int = 64) -> float:
    """Mean loss of the first `blocks` validation blocks of the built-in corpus (the fixture's own score)."""
    import torch

    from ..data.corpus import load_text, packed_blocks
    from ..models.builtin import TINY, build_model, load_tokenizer
    from ..models.loss import lm_loss

    model = build_model(str(model_or_dir), dtype=torch.float32) if isinstance(model_or_dir, (str, Path)) else model_or_dir
    val = packed_blocks(load_tokenizer(TINY), load_text()["validation"]["text"], seq_len)
    with torch.no_grad():
        vl = [lm_loss(model, val[i : i + 16]).item() for i in range(0, min(len(val), blocks), 16)]
    return sum(vl) / len(vl)


def _train(r: TinyTraining, out: Path, progress: bool) -> dict:
    import math

    import torch

    from ..data.corpus import load_text, packed_blocks
    from ..models.builtin import TINY, build_model, load_tokenizer

    tok = load_tokenizer(TINY)
    ds = load_text()
    train = packed_blocks(tok, ds["train"]["text"], r.seq_len)
    model = build_model(TINY, seed=r.seed)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(r.seed))
    # linear warm-up, then cosine to 10% of the peak
    losses = fit(model, lambda step: train[order[(torch.arange(r.batch) + step * r.batch) % len(train)]], r.steps, r.lr,
                 schedule=lambda s: min(1.0, (s + 1) / r.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, r.steps) / r.steps))),
                 clip=1.0, desc="training tiny-gemma3", progress=progress)
    vl = val_loss(model, r.seq_len)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return {"recipe": asdict(r), "final_train_loss": losses[-1], "val_loss_first_64_blocks": vl,
            "val_ppl_first_64_blocks": math.exp(vl)}
