"""What a training recipe reads: a prepared token store, or raw files prepared into the cache at start by all ranks.

Two calls, at the recipe's two moments:
- `check_data` (pre-flight, before any process group): the options validated, the inputs found, the tokenizer
  loaded and the store key computed, so a resume against other data is refused before anything launches;
- `ready_store` (every rank, before the process group): the store built (each rank tokenizes a share, rank 0
  merges, hfscale.data.store.prepare) or reused, and its train / validation rows as PackedDatasets.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..util.errors import HfscaleError
from .store import MANIFEST, DataOptions, StoreInfo, open_info, prepare, read_manifest, store_key


@dataclass(frozen=True)
class RunData:
    key: str
    options: DataOptions
    data: str  # sources as given, or a store directory
    store: Path  # where the store is (given) or will be (cache/data/<key>)
    prepared: bool  # data named a store made by `hfscale data prepare`
    tokenizer: object


def is_store(data) -> bool:
    return isinstance(data, str) and (Path(data) / MANIFEST).is_file()


def check_data(data, model: str, options: DataOptions, cache: Path) -> RunData:
    """Everything about the data that can fail, before any work: a given store's manifest and seq_len, or the
    sources' files; then the key the run's checkpoints record."""
    from .formats import data_tokenizer
    from .sources import files_of, parse_sources

    tokenizer = data_tokenizer(model)
    if is_store(data):
        m = read_manifest(data)
        if m["options"]["seq_len"] != options.seq_len:
            raise HfscaleError(f"the token store {data} was prepared for seq_len {m['options']['seq_len']}, this run uses "
                               f"{options.seq_len}; pass --seq-len {m['options']['seq_len']} or prepare the store again")
        return RunData(m["key"], options, data, Path(data), True, tokenizer)
    for s in parse_sources(data):
        files_of(s)
    if options.validation:
        from .sources import Source

        files_of(Source(options.validation))
    key = store_key(data, tokenizer, options)
    return RunData(key, options, data, cache / "data" / key, False, tokenizer)


def ready_store(run: RunData, rank: int, world: int) -> StoreInfo:
    """The store, built by all `world` ranks together if it is not there yet; every rank returns its info."""
    if run.prepared:
        return open_info(run.store)
    return prepare(run.data, run.tokenizer, run.options, run.store, rank=rank, world=world)


@dataclass(frozen=True)
class RunRows:
    """What a recipe's loop reads from the store: the train rows, the StepReader handing each step's packed micro
    batches and trained-token count (hfscale.train.loop.train_steps' read_batch / step_tokens), and the held-out
    rows as packed micro batches (loop.evaluate, compress.evaluate.score)."""
    train: object  # PackedDataset
    reader: object  # StepReader
    val: object  # MicroBatches

    @property
    def val_trained(self) -> int:
        """Trained tokens of the held-out rows: what an evaluation scores."""
        return self.val.dataset.trained_tokens(range(len(self.val.dataset)))


def run_rows(info: StoreInfo, plan, seed: int, train_rows: int = 0, eval_rows: int = 0,
             padding_free: bool = False) -> RunRows:
    """The store's rows as train_clm, qat_clm and distill_clm read them (`plan`: hfscale.data.sampler's batch plan);
    `padding_free`: each micro batch one row of its real tokens (hfscale.data.dataset; checked by TrainConfig)."""
    from .dataset import MicroBatches, PackedCollator, StepReader

    train, val = run_datasets(info, train_rows, eval_rows)
    collator = PackedCollator(train.seq_len, padding_free=padding_free)
    return RunRows(train, StepReader(train, plan, seed, collator), MicroBatches(val, plan.micro_batch, collator))


def run_datasets(info: StoreInfo, train_rows: int = 0, eval_rows: int = 0):
    """(train, validation) PackedDatasets of the store, limited to the first rows where asked (0: all)."""
    from .dataset import PackedDataset

    train = PackedDataset(info.path, "train", expect_key=info.key, limit=train_rows)
    val = PackedDataset(info.path, "validation", expect_key=info.key, limit=eval_rows)
    if len(train) == 0:
        raise HfscaleError(f"the token store {info.path} has no training rows; add data or lower seq_len")
    return train, val
