"""The sampler: global batch in tokens -> micro batch x accumulation x ranks, and which packed rows each rank reads.

The data order is a pure function of (seed, step): optimizer step s reads rows order[s*G : (s+1)*G]
(G rows per global batch, G = global batch tokens / seq_len, whatever the world size), and within it micro
step a of rank r reads the slice [(a*world + r)*micro, +micro). A resumed run therefore starts at the next
unseen row, exactly what the uninterrupted run would have read, with no data-loader state to save and no
fast-forward, at any world size (or sequence-parallel degree: `data_parallel`).

Every rank can count the trained tokens of a whole global step without communication (`step_trained`):
the rows of step s are known, and the store holds each row's trained-token count in a memory map.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..util.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int
    accum: int
    world: int
    seq_len: int

    @property
    def sequences_per_step(self) -> int:
        return self.micro_batch * self.accum * self.world

    @property
    def tokens_per_step(self) -> int:
        return self.sequences_per_step * self.seq_len

    def arithmetic(self) -> str:
        return (f"{self.micro_batch} micro × {self.accum} accum × {self.world} ranks × {self.seq_len} = "
                f"{self.tokens_per_step:,} tokens/step")


def plan_batch(global_batch_tokens: int, seq_len: int, world: int, micro_batch: int) -> BatchPlan:
    """Accumulation steps so that micro x accum x world x seq_len == global_batch_tokens exactly."""
    seqs, rest = divmod(global_batch_tokens, seq_len)
    if rest:
        raise ConfigError(f"global batch {global_batch_tokens:,} tokens is not a whole number of {seq_len}-token sequences")
    per_step = micro_batch * world
    if seqs % per_step:
        ok = [m for m in range(1, seqs + 1) if seqs % (m * world) == 0]
        hint = f"micro batch one of {ok[:6]}" if ok else f"a global batch that is a multiple of {world * seq_len:,} tokens"
        raise ConfigError(
            f"global batch {global_batch_tokens:,} tokens = {seqs} sequences does not divide into micro batch "
            f"{micro_batch} × {world} ranks; use {hint}"
        )
    return BatchPlan(micro_batch, seqs // per_step, world, seq_len)


@lru_cache(maxsize=4)
def epoch_order(n: int, seed: int, epoch: int):
    """A seeded permutation of the n sequences for one pass over the data."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def order_rows(n: int, seed: int, start: int, count: int):
    """The rows at positions start .. start + count of the run's endless order over n rows (epoch after epoch,
    each a seeded permutation): Long[count]."""
    import torch

    pos = torch.arange(start, start + count)
    epochs, within = pos // n, pos % n
    rows = torch.empty(count, dtype=torch.long)
    for e in epochs.unique().tolist():
        at = epochs == e
        rows[at] = epoch_order(n, seed, e)[within[at]]
    return rows


def rank_indices(plan: BatchPlan, n: int, seed: int, step: int, micro: int, rank: int):
    """Indices (into the n training sequences) that `rank` reads at optimizer step `step`, micro step `micro`."""
    return order_rows(n, seed, step * plan.sequences_per_step + (micro * plan.world + rank) * plan.micro_batch,
                      plan.micro_batch)


def step_rows(plan: BatchPlan, n: int, seed: int, step: int):
    """All rows of optimizer step `step` (every micro step of every rank), in the order ranks read them: micro step
    a of rank r is the slice [(a*world + r)*micro, +micro), as in rank_indices."""
    return order_rows(n, seed, step * plan.sequences_per_step, plan.sequences_per_step)


def step_trained(plan: BatchPlan, row_trained, seed: int, step: int) -> int:
    """Trained tokens (labels != -100) of the whole global step: what the step's loss divides by, the same on
    every rank. `row_trained`: the store's per-row counts (TokenStore.row_trained, a memory map)."""
    import numpy as np

    rows = step_rows(plan, len(row_trained), seed, step).numpy()
    return int(np.asarray(row_trained)[rows].sum())


def data_parallel(plan: BatchPlan, sp: int, rank: int) -> tuple[BatchPlan, int]:
    """Under sequence parallelism of degree `sp` the ranks of one SP group read the same rows: the batch plan
    counts groups, not ranks, and this rank reads as its group (DeepSpeed's SP groups are consecutive ranks)."""
    if sp <= 1:
        return plan, rank
    return plan_batch(plan.tokens_per_step, plan.seq_len, plan.world // sp, plan.micro_batch), rank // sp
