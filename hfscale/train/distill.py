"""Knowledge distillation for the recipes: a student trained on a frozen teacher's token distribution.

    loss = (1 - ce_weight) x T^2 x KL(softmax(teacher / T) || softmax(student / T)) + ce_weight x CE(data)

per next-token position (Hinton et al. 2015, "Distilling the Knowledge in a Neural Network": the T^2
keeps the gradient scale independent of T). Minitron (arXiv 2407.14679) recovers pruned models with
logit-only KL from the unpruned teacher, which is this with ce_weight 0. The loss itself is
hfscale.compress.qat.distillation_loss (one home; QAT's distillation uses it too).

The teacher is replicated: every rank holds a full frozen copy in eval mode (no gradients, no
optimizer state: its memory is its weights), outside DeepSpeed's engine. Sharding the teacher
(ZeRO-3 inference) is not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, HfscaleError
from .config import TrainConfig


@dataclass(frozen=True)
class DistillRecipeConfig(TrainConfig):
    """recipes/distill_clm.py: train `model` (the student, e.g. `hfscale prune`'s output) on `teacher`."""
    teacher: str = ""  # transformers dir (or built-in name) with the same vocabulary as `model`
    temperature: float = 1.0
    ce_weight: float = 0.0  # weight of next-token cross-entropy on the data; the KL term gets 1 - ce_weight

    def __post_init__(self):
        super().__post_init__()
        if not self.teacher:
            raise ConfigError("distillation needs a teacher: set teacher: (the unpruned model's directory) or --teacher DIR")
        if not 0.0 <= self.ce_weight < 1.0:
            raise ConfigError(f"ce_weight must be in [0, 1) (got {self.ce_weight}): the KL term gets 1 - ce_weight")
        if not self.temperature > 0:
            raise ConfigError(f"temperature must be > 0 (got {self.temperature})")


def check_pair(student_config, teacher_config, teacher: str) -> None:
    """The student can learn the teacher's distribution only over the same vocabulary."""
    vs, vt = student_config.vocab_size, teacher_config.vocab_size
    if vs != vt:
        raise HfscaleError(f"teacher {teacher} has a vocabulary of {vt:,} tokens, the student {vs:,}; distill from a "
                           "teacher with the student's tokenizer (the model it was pruned from)")


def load_teacher(name: str, device):
    """The frozen teacher: fp32, eval mode, no gradients."""
    import torch

    from ..models import build_model

    return build_model(name, dtype=torch.float32).to(device).eval().requires_grad_(False)


def kd_loss_fn(teacher, cfg):
    """A loss_fn(model, batch) for hfscale.train.loop.train_steps."""
    import torch

    from ..compress.qat import distillation_loss

    def loss_fn(model, batch):
        with torch.no_grad():
            t = teacher(input_ids=batch).logits
        return distillation_loss(model(input_ids=batch).logits, t, batch, 1.0 - cfg.ce_weight, cfg.temperature)

    return loss_fn


def heldout_kl(model, teacher, accelerator, val, micro_batch: int, temperature: float = 1.0) -> float:
    """Mean per-token T^2 x KL(teacher || student) over the held-out blocks, each rank an equal share
    (hfscale.train.loop.evaluate, scoring the KL instead of the data's cross-entropy)."""
    from .loop import evaluate

    return evaluate(_KLProbe(model, teacher, temperature), accelerator, val, micro_batch)


def _probe_base():
    import torch

    return torch.nn.Module


class _KLProbe(_probe_base()):
    """Looks like a causal LM to loop.evaluate: `.loss` is the student's KL to the teacher on the batch.
    train()/eval() switch the student only; the teacher stays in eval mode."""

    def __init__(self, student, teacher, temperature: float):
        super().__init__()
        self.student, self.temperature = student, temperature
        object.__setattr__(self, "teacher", teacher)  # not a submodule: train() must not reach it

    def train(self, mode: bool = True):
        self.student.train(mode)
        return self

    def forward(self, input_ids, labels=None):
        import types

        import torch

        from ..compress.qat import distillation_loss

        with torch.no_grad():
            t = self.teacher(input_ids=input_ids).logits
        return types.SimpleNamespace(loss=distillation_loss(self.student(input_ids=input_ids).logits, t, input_ids,
                                                            1.0, self.temperature))
