"""A token store as a torch Dataset + collator: for the recipes, transformers' Trainer and TRL's SFTTrainer.

    from hfscale.data import PackedDataset, PackedCollator
    train = PackedDataset("my_store")                          # made by `hfscale data prepare`
    respect_documents_(model)                                  # hfscale.models.documents: documents kept apart
    Trainer(model, args, train_dataset=train, data_collator=PackedCollator(train.seq_len))

The batch contract (what every consumer of a packed batch reads; nothing else is in the dict, so
`model(**batch)` works):
- `input_ids` Long[B, L];
- `labels` Long[B, L]: the token id where it is trained, -100 elsewhere: padding, untrained turns, and the
  first token of every document in a row, so no token is predicted from another document (the model shifts);
- `position_ids` Long[B, L]: 0, 1, ... restarting at every document; padding after a row's last document is
  one more run from 0 (a dummy document whose labels are all -100). Documents start exactly where
  position_ids go back to 0: the attention kernels take their boundaries from there.

Padding-free (`PackedCollator(padding_free=True)`, a recipe's `padding_free: true`): the micro batch's rows
concatenated into ONE row of their real tokens, B = 1, L = the rows' summed lengths, no padding at all (the layout
of transformers' DataCollatorWithFlattening and TRL's `padding_free`). Every row starts a document, so the
positions still restart per document and labels[:, 1:] counts the same trained tokens: the loss over them is the
padded layout's. Only for kernels that take the documents apart without a mask (hfscale.models.varlen, flash's
varlen path): under sdpa / eager that one row would get a (B x L)^2 mask (`check_padding_free`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

IGNORE = -100


class PackedDataset:
    """Row i of a store split: {"input_ids", "labels", "position_ids"} as 1-D int64 tensors (unpadded).
    A torch map-style dataset (only __len__ / __getitem__), reading the store's memory maps."""

    def __init__(self, store, split: str = "train", expect_key: str | None = None, limit: int = 0):
        from .store import TokenStore

        self.store = store if not isinstance(store, (str, Path)) else TokenStore(store, split, expect_key)
        self.seq_len = self.store.seq_len
        self.n = min(len(self.store), limit) if limit else len(self.store)  # the first `limit` rows only

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        import torch

        if not -len(self) <= i < len(self):
            raise IndexError(i)
        ids, labels, pos = self.store.row(int(i) % len(self))
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(pos)}

    def as_iterable(self, seed: int = 0):
        """A `datasets.IterableDataset` of the rows (for TRL's SFTTrainer, which takes only `datasets` types):
        streamed from the memory maps, every epoch in the sampler's seeded order (hfscale.data.sampler.epoch_order).
        Give the trainer max_steps (an iterable has no length) and dataset_kwargs={"skip_prepare_dataset": True}."""
        import datasets

        def rows(n=len(self), store=self.store):
            from .sampler import epoch_order

            epoch = 0
            while True:
                for i in epoch_order(n, seed, epoch).tolist():
                    ids, labels, pos = store.row(i)
                    yield {"input_ids": ids, "labels": labels, "position_ids": pos}
                epoch += 1

        return datasets.IterableDataset.from_generator(rows)

    def trained_tokens(self, rows) -> int:
        return int(np.asarray(self.store.row_trained)[np.asarray(rows, dtype=np.int64)].sum())


class PackedCollator:
    """Rows -> the batch contract, padded to `seq_len` (or, with pad_to="longest", the batch's longest row); with
    padding_free, the rows as one row of their real tokens, [1, sum of their lengths] (pad_to unused)."""

    def __init__(self, seq_len: int | None = None, pad_id: int = 0, pad_to: str = "max", padding_free: bool = False):
        if pad_to not in ("max", "longest") or (pad_to == "max" and not seq_len and not padding_free):
            raise ValueError("pad_to is 'max' (with seq_len) or 'longest'")
        self.seq_len, self.pad_id, self.pad_to, self.padding_free = seq_len, pad_id, pad_to, padding_free

    def __call__(self, features: list[dict]) -> dict:
        import torch

        if self.padding_free:  # every row starts a document (position 0, label -100): nothing crosses a row's seam
            return {k: torch.cat([torch.as_tensor(f[k]) for f in features])[None]
                    for k in ("input_ids", "labels", "position_ids")}
        n = max(len(f["input_ids"]) for f in features)
        L = n if self.pad_to == "longest" else self.seq_len
        ids = torch.full((len(features), L), self.pad_id, dtype=torch.long)
        labels = torch.full((len(features), L), IGNORE, dtype=torch.long)
        pos = torch.arange(L, dtype=torch.long).repeat(len(features), 1)
        for b, f in enumerate(features):
            k = len(f["input_ids"])
            ids[b, :k] = torch.as_tensor(f["input_ids"])
            labels[b, :k] = torch.as_tensor(f["labels"])
            pos[b, :k] = torch.as_tensor(f["position_ids"])
            pos[b, k:] -= k  # the padding: its own run of positions from 0
        return {"input_ids": ids, "labels": labels, "position_ids": pos}


# kernels that keep a padding-free row's documents apart without a mask (hfscale.models.varlen.ATTENTION's names)
PADDING_FREE_ATTENTION = ("varlen", "flash_attention_2", "flash_attention_3")


def keeps_documents_apart(attention) -> bool:
    """Whether a kernel keeps a flat row's documents apart by their position ids alone (no mask): hfscale's varlen,
    flash-attention's varlen path (any flash kernel transformers runs). The one rule: the recipe and doctor read it."""
    from ..models.documents import is_flash
    from ..models.varlen import NAME

    return isinstance(attention, str) and (attention in (*PADDING_FREE_ATTENTION, NAME) or is_flash(attention))


def check_padding_free(padding_free: bool, attention: str | None, sp: int = 1) -> None:
    """Refuse (ConfigError, one line) a padding-free layout the kernel or the sequence split cannot keep apart."""
    from ..util.errors import ConfigError

    if not padding_free:
        return
    if not keeps_documents_apart(attention):
        kernel = f"attention {attention}" if attention else "the model's own attention (attention unset)"
        raise ConfigError(f"padding_free: true puts each micro batch in one row of up to micro_batch x seq_len tokens, and "
                          f"under {kernel} that row gets a (micro_batch x seq_len)^2 mask; set attention: varlen (or "
                          "flash_attention_2 on CUDA), or drop padding_free")
    if sp > 1:
        raise ConfigError(f"padding_free: true cannot run under Ulysses SP (sp {sp}): the sequence split needs rows of "
                          "one length divisible by sp, a padding-free row has the micro batch's own length; drop "
                          "padding_free (packed rows of seq_len keep their documents apart under SP)")


def batch_of(dataset: PackedDataset, rows, collator: PackedCollator) -> dict:
    """The batch of these rows (indices from hfscale.data.sampler)."""
    return collator([dataset[int(i)] for i in rows])


class StepReader:
    """What a training loop reads at optimizer step `step` (hfscale.train.loop.train_steps' `read_batch` and
    `step_tokens`): rank `rank`'s packed micro batch `micro` (its rows from hfscale.data.sampler.rank_indices, as
    the batch contract), and the step's trained-token count over every micro batch and rank, without communication
    (the store's per-row counts of labels[:, 1:] != -100: what hfscale.models.loss sums over)."""

    def __init__(self, dataset: PackedDataset, plan, seed: int, collator: PackedCollator | None = None):
        self.dataset, self.plan, self.seed = dataset, plan, seed
        self.collator = collator or PackedCollator(dataset.seq_len)

    def batch(self, step: int, micro: int, rank: int) -> dict:
        from .sampler import rank_indices

        return batch_of(self.dataset, rank_indices(self.plan, len(self.dataset), self.seed, step, micro, rank),
                        self.collator)

    def trained(self, step: int) -> int:
        from .sampler import step_trained

        # the dataset's rows only (a `limit` reads the first rows of the store)
        return step_trained(self.plan, self.dataset.store.row_trained[: len(self.dataset)], self.seed, step)


class MicroBatches:
    """A split's rows in order as packed micro batches of `micro_batch` rows (the last may be shorter): a lazy
    sequence (len, [j]) for hfscale.train.loop.evaluate; a batch is collated only when it is read."""

    def __init__(self, dataset: PackedDataset, micro_batch: int, collator: PackedCollator | None = None):
        self.dataset, self.micro_batch = dataset, micro_batch
        self.collator = collator or PackedCollator(dataset.seq_len)

    def __len__(self) -> int:
        return -(-len(self.dataset) // self.micro_batch)

    def __getitem__(self, j: int) -> dict:
        if not 0 <= j < len(self):
            raise IndexError(j)
        lo = j * self.micro_batch
        return batch_of(self.dataset, range(lo, min(lo + self.micro_batch, len(self.dataset))), self.collator)
