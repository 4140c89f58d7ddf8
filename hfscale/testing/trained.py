"""Test support (tests and benchmarks; not used by the package itself). A trained copy of the built-in tiny Gemma 3, for everything that needs a model that has learnt
something: quantization quality (PTQ vs QAT), export checks (GGUF, .pte), evaluation.

A random-init model makes quality numbers meaningless (every scheme is "equally bad"), so this
trains the tiny model on the built-in corpus with a plain single-process loop — deterministic for
a given (steps, seq_len, batch, lr, seed) — and caches the result as a transformers directory
(safetensors + tokenizer) under $HFSCALE_CACHE (default ~/.cache/hfscale). Cluster training
goes through recipes/train_clm.py; this is a fixed, small fixture.
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

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule else None
    model.train()
    losses = []
    for step in tqdm(range(steps), desc=desc, disable=not progress):
        batch = next_batch(step)
        loss = model(input_ids=batch, labels=batch).loss
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

    def build(tmp: Path) -> None:
        info = _train(recipe, tmp, progress)
        (tmp / "hfscale_training.json").write_text(json.dumps(info, indent=2) + "\n")

    return cached_dir("tiny-gemma3-trained", recipe.key(), build, "hfscale_training.json", cache)


def _train(r: TinyTraining, out: Path, progress: bool) -> dict:
    import math

    import torch

    from ..data.corpus import load_text, packed_blocks
    from ..models.builtin import TINY, build_model, load_tokenizer

    tok = load_tokenizer(TINY)
    ds = load_text()
    train = packed_blocks(tok, ds["train"]["text"], r.seq_len)
    val = packed_blocks(tok, ds["validation"]["text"], r.seq_len)
    model = build_model(TINY, seed=r.seed)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(r.seed))
    # linear warm-up, then cosine to 10% of the peak
    losses = fit(model, lambda step: train[order[(torch.arange(r.batch) + step * r.batch) % len(train)]], r.steps, r.lr,
                 schedule=lambda s: min(1.0, (s + 1) / r.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, r.steps) / r.steps))),
                 clip=1.0, desc="training tiny-gemma3", progress=progress)
    with torch.no_grad():
        vl = [model(input_ids=val[i : i + 16], labels=val[i : i + 16]).loss.item() for i in range(0, min(len(val), 64), 16)]
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return {"recipe": asdict(r), "final_train_loss": losses[-1], "val_loss_first_64_blocks": sum(vl) / len(vl),
            "val_ppl_first_64_blocks": math.exp(sum(vl) / len(vl))}
