"""The fine-tune every QAT benchmark arm runs: the same loop with and without fake quantization.

A QAT number only means something against a control - the same fine-tune (data order, steps, lr
schedule, loss) of the same start without fake quantization - because the fine-tune itself moves
the float model. `FineTune` fixes everything but the model; `finetune` runs it on whatever model it
is given (plain, fake-quantized, or with a teacher for distillation).

Schedule: linear warm-up, then cosine to zero. Measured in benchmarks/compress.py's exploration
(tiny Gemma 3, 300 steps, lr 3e-4): at a constant lr the QAT arms ended at -3.5% (8da4w) and 24%
(int4wo) of PTQ's loss recovered; the same steps decayed to zero gave 61% and 70%. A constant lr
leaves the float weights jittering across rounding boundaries at the end of training.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm


@dataclass(frozen=True)
class FineTune:
    steps: int = 1200
    lr: float = 1e-4
    batch: int = 8          # blocks of seq_len tokens per step
    warmup: int = 10
    seed: int = 1           # data order
    distill: float = 0.0    # weight of KL to the teacher (hfscale.compress.qat.distillation_loss)

    def lr_at(self, step: int) -> float:
        warm = min(1.0, (step + 1) / self.warmup)
        return self.lr * warm * 0.5 * (1 + math.cos(math.pi * step / self.steps))


def finetune(model, train: torch.Tensor, ft: FineTune, teacher=None, desc: str | None = None) -> float:
    """Train `model` in place on blocks of `train` per `ft`; returns seconds per step."""
    from hfscale.compress.qat import distillation_loss

    if ft.distill and teacher is None:
        raise ValueError("distill > 0 needs a teacher")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(ft.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=ft.lr, weight_decay=0.0)
    model.train()
    t0 = time.perf_counter()
    for s in tqdm(range(ft.steps), desc=desc, disable=desc is None, mininterval=10):
        for g in opt.param_groups:
            g["lr"] = ft.lr_at(s)
        b = train[order[(torch.arange(ft.batch) + s * ft.batch) % len(train)]]
        if ft.distill:
            with torch.no_grad():
                t = teacher(input_ids=b).logits
            loss = distillation_loss(model(input_ids=b).logits, t, b, ft.distill)
        else:
            loss = model(input_ids=b, labels=b).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    return (time.perf_counter() - t0) / ft.steps
