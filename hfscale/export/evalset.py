"""The held-out texts every runtime check uses: a prompt set and a perplexity slice.

Both come from the built-in corpus's validation split (never trained on), so agreement and
perplexity numbers are comparable across formats, qtypes and runtimes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EvalSet:
    n_prompts: int = 8
    prompt_tokens: int = 96  # > the tiny model's 64-token sliding window, so SWA is exercised
    ppl_blocks: int = 8
    seq_len: int = 128

    def __post_init__(self):
        if min(self.n_prompts, self.prompt_tokens, self.ppl_blocks, self.seq_len) < 1:
            raise ValueError("EvalSet sizes must all be >= 1")


def prompt_texts(es: EvalSet) -> list[str]:
    from ..data.corpus import load_text

    val = load_text()["validation"]["text"]
    return [t for t in val if len(t) > 200][: es.n_prompts]


# a small conversation for the tokenizer's chat template (when it has one)
CHAT = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris. It has been the capital since 987."},
        {"role": "user", "content": "And of Italy?"}]


# text the corpus rarely holds but pre-tokenizers split differently: contractions in both cases, digit runs
# (llama3 groups up to 3, qwen2 splits each), runs of spaces / tabs / newlines / \r\n, leading and trailing
# spaces, accents, CJK, Greek, an emoji (byte fallback / multi-byte BPE), code (all NFC)
PROBE = ["I'M sure they'LL say we'd've DON'T know: it's 12345 or 3.14159, on 2026-12-07!",
         "Tabs\tand  double  spaces,   trailing   \n\n\nnew\r\nlines \n  indented\n",
         "   leading spaces and a final space ",
         "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 \u6771\u4eac \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac "
         "\U0001f642 \u00bfqu\u00e9?",
         "def f(x):\n    return x**2  # squared\n"]


def tokenizer_texts(tokenizer, es: EvalSet) -> list[str]:
    """What a runtime's tokenizer must split exactly as `tokenizer` does: the held-out prompts, the PROBE
    texts, one text per added token (special or not) inside prose, all of them in a row, and the chat
    template applied to CHAT if the tokenizer has a template."""
    added = sorted(t.content for t in tokenizer.added_tokens_decoder.values())
    texts = prompt_texts(es) + PROBE + [f"Before {a}after, and{a} again: {a}\n" for a in added]
    if added:
        texts.append("".join(added) + " " + " ".join(added))
    if getattr(tokenizer, "chat_template", None):
        texts.append(tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))
    return texts


def prompt_ids(tokenizer, es: EvalSet) -> list[list[int]]:
    """bos + the first tokens of each held-out document (the tokenizer's own special tokens)."""
    return [tokenizer(t).input_ids[: es.prompt_tokens] for t in prompt_texts(es)]


def ppl_blocks(tokenizer, es: EvalSet):
    """The first `ppl_blocks` packed blocks of the validation split: the same slice `hfscale eval` scores."""
    from ..compress.evaluate import EvalData, heldout_blocks

    return heldout_blocks(tokenizer, EvalData(seq_len=es.seq_len, n_blocks=es.ppl_blocks))


def nll_from_logits(logits, ids) -> tuple[float, int]:
    """Summed next-token NLL of ids[1:] under logits[:-1] (numpy or torch), and the count."""
    import torch

    lg = torch.as_tensor(logits, dtype=torch.float32)[:-1]
    tgt = torch.as_tensor(ids, dtype=torch.long)[1:]
    return float(torch.nn.functional.cross_entropy(lg, tgt, reduction="sum")), int(tgt.numel())


def ppl(total_nll: float, n: int) -> float:
    return math.exp(total_nll / n)


def eager_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()


def compare(ref, got) -> dict:
    """max|Δlogit| and top-1 agreement over every position of one sequence."""
    import numpy as np

    return {"max_abs_dlogit": float(np.abs(ref - got).max()),
            "top1_agree": int((ref.argmax(-1) == got.argmax(-1)).sum()), "positions": int(ref.shape[0])}


def merge(rows: list[dict]) -> dict:
    n = sum(r["positions"] for r in rows)
    return {"max_abs_dlogit": max(r["max_abs_dlogit"] for r in rows),
            "top1_agreement": sum(r["top1_agree"] for r in rows) / n, "positions": n}
