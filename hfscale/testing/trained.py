"""Test support (tests and benchmarks; not used by the package itself). A trained copy of the built-in tiny Gemma 3, for everything that needs a model that has learnt
something: quantization quality (PTQ vs QAT), export checks (GGUF, .pte), evaluation.

A random-init model makes quality numbers meaningless (every scheme is "equally bad"), so this
trains the tiny model on the built-in corpus with a plain single-process loop — deterministic for
a given (steps, seq_len, batch, lr, seed) and host — and caches the result as a transformers directory
(safetensors + tokenizer) under $HFSCALE_CACHE (default ~/.cache/hfscale). Cluster training
goes through recipes/train_clm.py; this is a fixed, small fixture.

The default recipe's result ships in hfscale/models/data/trained/ (bf16 weights, made by
tools/build_trained_tiny.py; its home is hfscale.models.trained, which the demo uses too): `trained_tiny()`
copies it (as fp32) instead of training, so a fresh test run spends no time on it and every host tests the same
weights. Other recipes are trained here.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ..models.trained import NAME, SHIPPED_FILES, copy_shipped, shipped_dir, shipped_info  # noqa: F401 (SHIPPED_FILES re-exported)
from ..util.cache import cached_dir  # noqa: F401 (tiny_moe's cache too)


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


def _shipped(recipe: TinyTraining) -> Path | None:
    """The shipped directory if it holds `recipe`'s result (its recorded recipe key), else None."""
    info = shipped_info()
    return shipped_dir() if info is not None and info["recipe_key"] == recipe.key() else None


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
            copy_shipped(tmp, shipped)
            return
        info = _train(recipe, tmp, progress)
        (tmp / "hfscale_training.json").write_text(json.dumps(info, indent=2) + "\n")

    return cached_dir(NAME, recipe.key(), build, "hfscale_training.json", cache)


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
