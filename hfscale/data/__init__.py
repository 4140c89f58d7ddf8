"""Users' data, at any size: sources, formats and loss masks, the token store every rank memory-maps, packing,
the sampler, and a torch Dataset + collator (docs/data.md).

    from hfscale.data import DataOptions, prepare, PackedDataset, PackedCollator
    info = prepare("chat.jsonl", tokenizer, DataOptions(seq_len=2048), "store")   # rank=, world= to share the work
    train = PackedDataset(info.path)

No accelerate, no process group here: ranks coordinate through staged renames (hfscale.data.store).
"""

from .dataset import PackedCollator, PackedDataset
from .store import DataOptions, StoreInfo, TokenStore, open_info, prepare, store_key

__all__ = ["DataOptions", "PackedCollator", "PackedDataset", "StoreInfo", "TokenStore", "open_info", "prepare", "store_key"]
