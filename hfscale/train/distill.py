"""Knowledge distillation for the recipes: a student trained on a frozen teacher's token distribution.

    loss = (1 - ce_weight) x T^2 x KL(softmax(teacher / T) || softmax(student / T)) + ce_weight x CE(data)

per next-token position (Hinton et al. 2015, "Distilling the Knowledge in a Neural Network": the T^2
keeps the gradient scale independent of T). Minitron (arXiv 2407.14679) recovers pruned models with
logit-only KL from the unpruned teacher, which is this with ce_weight 0. The loss itself is
hfscale.compress.qat.distillation_loss (one home; QAT's distillation uses it too).

Where the frozen teacher lives is `teacher_placement` (TEACHER_PLACEMENTS):
  replicated  every rank holds a full fp32 copy in eval mode (no gradients, no optimizer state: its
              memory is its weights), outside any engine;
  zero3       the teacher gets its own DeepSpeed ZeRO-3 engine without an optimizer (DeepSpeed's
              "ZeRO-Inference": deepspeed.initialize(model=teacher) with stage 3 builds a
              DeepSpeedZeRoOffload that partitions the parameters and gathers each module's for its
              forward, releasing them after), whatever ZeRO stage the student trains under. Each rank
              keeps 1/world of every teacher tensor (persistence thresholds 0: no small tensor stays
              whole) and the teacher's logits are those of the whole model. It is loaded whole on each
              rank first and partitioned after (no zero.Init at load): the load peak is the full model.
Ran on CPU only (2 gloo processes, ZeRO-2 student, tests/test_distill_path.py): zero3 holds half of
every tensor per rank and gives the replicated run's losses. A ZeRO-3 student with a zero3 teacher, and
--resume latest under it, ran by hand (3 steps, the same losses); never on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..util.errors import ConfigError, HfscaleError
from .config import TrainConfig, train_clm_only

TEACHER_PLACEMENTS = {"replicated": "a full frozen copy on every rank",
                      "zero3": "partitioned over the ranks by its own DeepSpeed ZeRO-3 engine (needs a DeepSpeed launch)"}


@dataclass(frozen=True)
class DistillRecipeConfig(TrainConfig):
    """recipes/distill_clm.py: train `model` (the student, e.g. `hfscale prune`'s output) on `teacher`."""
    teacher: str = ""  # transformers dir (or built-in name) with the same vocabulary as `model`
    temperature: float = 1.0
    ce_weight: float = 0.0  # weight of next-token cross-entropy on the data; the KL term gets 1 - ce_weight
    teacher_placement: str = "replicated"  # replicated | zero3 (TEACHER_PLACEMENTS)

    def __post_init__(self):
        train_clm_only(self, "distill_clm")
        super().__post_init__()
        if not self.teacher:
            raise ConfigError("distillation needs a teacher: set teacher: (the unpruned model's directory) or --teacher DIR")
        if not 0.0 <= self.ce_weight < 1.0:
            raise ConfigError(f"ce_weight must be in [0, 1) (got {self.ce_weight}): the KL term gets 1 - ce_weight")
        if not self.temperature > 0:
            raise ConfigError(f"temperature must be > 0 (got {self.temperature})")
        if self.adapter != "none":  # its recipe builds the student in full; an adapter would be silently ignored
            raise ConfigError(f"distill_clm trains the whole student (got adapter {self.adapter}); drop --adapter, "
                              "or fine-tune with adapters in recipes/train_clm.py")
        if self.attention:  # train_clm applies it; student and teacher keep their own kernel here
            raise ConfigError(f"distill_clm runs the models' own attention kernel (got attention {self.attention}); "
                              "drop attention / --attention (recipes/train_clm.py applies it)")
        if self.teacher_placement not in TEACHER_PLACEMENTS:
            raise ConfigError(f"teacher_placement {self.teacher_placement!r} not understood; use one of "
                              + ", ".join(f"{k} ({v})" for k, v in TEACHER_PLACEMENTS.items()))


def check_placement(cfg: DistillRecipeConfig, environ) -> None:
    """zero3 needs DeepSpeed in the launch (read from the launcher's environment, passed in)."""
    if cfg.teacher_placement == "zero3" and environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        raise HfscaleError("teacher_placement zero3 shards the teacher with DeepSpeed, but this is not a DeepSpeed launch; "
                           "launch with accelerate launch --config_file accelerate_configs/zero2.yaml (or zero3.yaml), "
                           "or set --teacher-placement replicated")


def check_pair(student_config, teacher_config, teacher: str) -> None:
    """The student can learn the teacher's distribution only over the same vocabulary."""
    vs, vt = student_config.vocab_size, teacher_config.vocab_size
    if vs != vt:
        raise HfscaleError(f"teacher {teacher} has a vocabulary of {vt:,} tokens, the student {vs:,}; distill from a "
                           "teacher with the student's tokenizer (the model it was pruned from)")


def load_teacher(name: str, device, placement: str = "replicated"):
    """The frozen teacher: fp32, eval mode, no gradients; with placement zero3, partitioned (shard_zero3)."""
    import torch

    from ..models.builtin import build_model

    teacher = build_model(name, dtype=torch.float32).to(device).eval().requires_grad_(False)
    return shard_zero3(teacher) if placement == "zero3" else teacher


def shard_zero3(module):
    """`module` under its own DeepSpeed ZeRO-3 engine, no optimizer, fp32: each rank keeps its 1/world
    partition of every parameter; forward hooks gather a module's parameters and release them after."""
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,  # required keys; nothing trains
              "bf16": {"enabled": False}, "fp16": {"enabled": False},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_model_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                                    "stage3_max_reuse_distance": 0},
              "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=module, config=config)
    return engine.module.eval()


@dataclass(frozen=True)
class TeacherShare:
    """What one rank holds of the teacher's parameters."""
    rank: int
    numel: int  # elements this rank stores (ZeRO-3: its padded partitions; replicated: all)
    bytes: int
    resident_numel: int  # elements of whole (gathered or replicated) tensors alive now: 0 for zero3 between forwards
    total_numel: int  # the teacher's parameter count


def teacher_share(teacher, rank: int) -> TeacherShare:
    params = list(teacher.parameters())
    part = [getattr(p, "ds_tensor", p) for p in params]
    return TeacherShare(rank, sum(t.numel() for t in part), sum(t.numel() * t.element_size() for t in part),
                        sum(p.data.numel() for p in params), sum(getattr(p, "ds_numel", p.numel()) for p in params))


def gather_shares(accelerator, teacher) -> list[TeacherShare]:
    """Every rank's TeacherShare, on every rank (one all-gather)."""
    import torch

    mine = teacher_share(teacher, accelerator.process_index)
    row = torch.tensor([mine.rank, mine.numel, mine.bytes, mine.resident_numel, mine.total_numel], dtype=torch.int64,
                       device=accelerator.device)
    rows = accelerator.gather(row).reshape(-1, 5).tolist()
    return [TeacherShare(*map(int, r)) for r in rows]


def kd_loss_fn(teacher, cfg):
    """A loss_fn(model, batch[, denominator]) for hfscale.train.loop.train_steps (the distill recipe's settings)."""
    return distill_loss_fn(teacher, 1.0 - cfg.ce_weight, cfg.temperature)


def distill_loss_fn(teacher, weight: float, temperature: float = 1.0):
    """A loss_fn(model, batch[, denominator]) for hfscale.train.loop.train_steps: hfscale.compress.qat's
    distillation_loss against the frozen `teacher` (weight on the KL; the distill and QAT recipes). Full blocks (a
    tensor, every next token trained) or a packed batch (hfscale.models.documents: documents kept apart in the
    teacher and the student, CE and KL over its trained tokens / the step's `denominator`)."""
    import torch

    from ..compress.qat import distillation_loss

    def loss_fn(model, batch, denominator=None):
        inputs, labels = model_inputs(batch, model)
        with torch.no_grad():
            t = teacher(**model_inputs(batch, teacher)[0]).logits
        return distillation_loss(model(**inputs).logits, t, labels, weight, temperature, denominator)

    return loss_fn


def model_inputs(batch, model):
    """(forward kwargs without labels, labels) for full blocks (a tensor: labels = inputs) or a packed batch."""
    import torch

    from ..models.documents import attn_implementation, forward_kwargs

    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch}, batch
    inputs = forward_kwargs({k: v for k, v in batch.items() if k != "labels"}, attn_implementation(model))
    return inputs, batch["labels"]


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

    def forward(self, input_ids, labels=None, num_items_in_batch=None, **packed):
        """Full blocks (input_ids only: every next token) or a packed batch (labels, position_ids and
        hfscale.models.documents' forward kwargs), as loop.evaluate passes them."""
        import types

        import torch

        from ..compress.qat import distillation_loss

        labels = input_ids if labels is None else labels
        with torch.no_grad():
            t = self.teacher(input_ids=input_ids, **packed).logits
        return types.SimpleNamespace(loss=distillation_loss(self.student(input_ids=input_ids, **packed).logits, t,
                                                            labels, 1.0, self.temperature, num_items_in_batch))
