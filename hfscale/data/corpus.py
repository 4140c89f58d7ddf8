"""The embedded corpus, read as `datasets` splits, and plain token blocks for scoring and proofs.

Text: CPython 3.11's documentation prose (PSF License, see hfscale/models/data/corpus/LICENSE),
1.57M characters of train and 93K of held-out validation, split by document. Loaded through
`datasets` like any user's jsonl, so a user's files go through the same code.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..util.errors import HfscaleError, first_line
from .sources import looks_like_hub_name, offline_refusal

BUILTIN_CORPUS = "builtin"


def corpus_files() -> dict[str, str]:
    root = Path(str(resources.files("hfscale.models") / "data" / "corpus"))  # package data stays in models/
    return {"train": str(root / "train.jsonl.gz"), "validation": str(root / "validation.jsonl.gz")}


def load_text(data: str = BUILTIN_CORPUS, validation: str | None = None):
    """A `datasets.DatasetDict` with "train" and "validation" splits and a "text" column.

    `data` is "builtin", or a local .txt / .jsonl / .json / .parquet file (optionally with a
    separate validation file; otherwise 5% of the train rows are held out with a fixed seed).
    """
    import datasets

    if data == BUILTIN_CORPUS:
        files = corpus_files()
        return datasets.DatasetDict({k: _read_one(v, "json") for k, v in files.items()})
    if looks_like_hub_name(data):
        return _load_hub(data)
    train = _read_one(data)
    if validation:
        return datasets.DatasetDict(train=train, validation=_read_one(validation))
    split = train.train_test_split(test_size=0.05, seed=0)
    return datasets.DatasetDict(train=split["train"], validation=split["test"])


BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _read_one(path: str, builder: str | None = None):
    """One local file as a `datasets.Dataset` with a "text" column; every failure is one HfscaleError line."""
    import datasets

    if not Path(path).is_file():
        raise HfscaleError(f"data file {path} not found; pass an existing .txt/.jsonl/.parquet file or 'builtin'")
    builder = builder or BUILDERS.get(Path(Path(path).name.removesuffix(".gz")).suffix)
    if builder is None:
        raise HfscaleError(f"cannot read {path}: use a .txt, .jsonl, .json or .parquet file")
    try:
        ds = datasets.load_dataset(builder, data_files={"train": str(path)})["train"]
    except Exception as e:  # pyarrow / datasets raise many types for a malformed file
        cause = e.__cause__ or e
        raise HfscaleError(f"cannot read {path} as {builder} ({first_line(cause, 160)}); "
                           "check the file's format matches its extension") from None
    if "text" not in ds.column_names:
        raise HfscaleError(f"{path} has no 'text' column (columns: {ds.column_names})")
    kind = getattr(ds.features["text"], "dtype", type(ds.features["text"]).__name__)
    if kind not in ("string", "large_string"):
        raise HfscaleError(f"{path}: its 'text' column holds {kind}, not strings; give each record a \"text\": \"...\" string")
    return ds


def _load_hub(name: str):
    """A hub dataset with a "text" column (network needed); validation split or 5% held out."""
    import datasets

    offline_refusal(name)
    try:
        ds = datasets.load_dataset(name)
    except Exception as e:  # hub errors come in many types; the user needs the first line
        raise HfscaleError(f"cannot load dataset {name} from the hub ({first_line(e, 160)})") from None
    if "text" not in ds["train"].column_names:
        raise HfscaleError(f"{name} has no 'text' column (columns: {ds['train'].column_names})")
    if "validation" not in ds:
        split = ds["train"].train_test_split(test_size=0.05, seed=0)
        ds = datasets.DatasetDict(train=split["train"], validation=split["test"])
    return ds


def packed_blocks(tokenizer, texts, seq_len: int):
    """Documents (bos ... eos each) packed `wrapped` (hfscale.data.packing) into rows of `seq_len` tokens, as an int64
    tensor [n_rows, seq_len] of token ids only (the last partial row dropped). For callers that score or prove on
    plain blocks; training reads a store's rows with their labels and document boundaries (hfscale.data.dataset)."""
    import numpy as np
    import torch

    from .formats import Tok, _wrap
    from .packing import pack

    tok = Tok(tokenizer, tokenizer.bos_token_id, tokenizer.eos_token_id, "")  # _wrap reads bos / eos only
    docs = [_wrap(tok, d) for d in tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]]
    lens = np.array([len(d) for d in docs], dtype=np.int64)
    rows = pack(lens, seq_len, "wrapped").rows
    if rows == 0:
        raise HfscaleError(f"the data holds {int(lens.sum())} tokens, fewer than one block of {seq_len}; lower --seq-len")
    flat = np.fromiter((t for d in docs for t in d), dtype=np.int64, count=int(lens.sum()))
    return torch.from_numpy(flat[: rows * seq_len].copy()).view(rows, seq_len)
