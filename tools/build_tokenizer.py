"""Rebuild the embedded tokenizer shipped in hfscale/models/data/tokenizer/ (transformers format).

A SentencePiece-style BPE (Gemma's scheme: "▁" marks spaces, byte fallback for anything outside the
vocabulary, Gemma's special-token ids pad=0 eos=1 bos=2 unk=3), trained with the `tokenizers`
library on the train split of the embedded corpus. Deterministic for a fixed corpus.
Run from the repository root:  .venv/bin/python tools/build_tokenizer.py
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "hfscale" / "data" / "corpus" / "train.jsonl.gz"
OUT = ROOT / "hfscale" / "data" / "tokenizer"
VOCAB_SIZE = 4096
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
BYTES = [f"<0x{i:02X}>" for i in range(256)]


def texts():
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def main() -> int:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    # split before each "▁" so merges stay inside words, as SentencePiece does
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL + BYTES,
        limit_alphabet=200,  # rare characters fall back to bytes
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer=trainer)
    # The trainer only reserves vocabulary ids through `special_tokens`; byte tokens must stay
    # ordinary vocabulary (decoded by ByteFallback, never skipped as "special"), so drop them from
    # the added-tokens table again. Their ids 4..259 stay in the BPE vocabulary.
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in SPECIAL]
    tok = Tokenizer.from_str(json.dumps(spec))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        add_bos_token=True,
        model_max_length=8192,
        padding_side="left",
    )
    fast.save_pretrained(OUT)
    print(f"vocab {tok.get_vocab_size()} -> {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
