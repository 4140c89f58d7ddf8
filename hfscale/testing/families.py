"""Small random-weight decoders of the families `hfscale prune` supports, each with a tokenizer of its family's
kind, saved as transformers directories: the sources the GGUF export is checked on (tests/test_export_gguf_families.py)
and the teacher of the `hfscale bench` run in docs/export.md.

Shapes follow each family's real config scaled down (2 layers, hidden 64, GQA 4:2), keeping what sets it apart:
- llama: Llama 3.2 — llama3 RoPE scaling (factor 32, low/high 1/4, here over 64 original positions so that it
  changes the angles the checks exercise), rope theta 500,000, tied head, byte-level BPE with Llama 3's
  pre-tokenizer regex, ignore_merges, bos added.
- mistral: Mistral v0.3 — no sliding window, theta 1e6, untied head, SentencePiece-style tokenizer (the built-in
  byte-fallback BPE).
- qwen2: Qwen 2.5 — q/k/v biases, tied head, byte-level BPE with Qwen's regex and NFC normalizer, no bos.
- qwen3: Qwen 3 — head_dim 32 != hidden/heads, q/k RMSNorms, untied head, linear RoPE scaling (factor 2),
  Qwen's tokenizer.
Tokenizers are trained here (`tokenizers` BpeTrainer, 1,024 tokens) on the built-in corpus's train split, with
special tokens and one non-special added token like the real ones. Norm weights, biases and q/k norms are drawn
away from their init (ones / zeros) so that the export must carry them.
"""

from __future__ import annotations

from pathlib import Path

from ..export.gguf_bpe import LLAMA3_REGEX, QWEN2_REGEX

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512)
BPE_VOCAB = 1024

TOKENIZERS = {
    "llama3": dict(regex=LLAMA3_REGEX, ignore_merges=True, nfc=False, bos="<|begin_of_text|>", eos="<|end_of_text|>",
                   special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eot_id|>"], user=["<|python_tag|>"]),
    "qwen2": dict(regex=QWEN2_REGEX, ignore_merges=False, nfc=True, bos=None, eos="<|endoftext|>",
                  special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], user=["<tool_call>", "</tool_call>"]),
}


def bpe_tokenizer(kind: str, n_docs: int = 2000):
    """A byte-level BPE tokenizer (PreTrainedTokenizerFast) of Llama 3's or Qwen's structure."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from ..data.corpus import load_text

    spec = TOKENIZERS[kind]
    tok = Tokenizer(models.BPE(ignore_merges=spec["ignore_merges"]))
    if spec["nfc"]:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec["regex"]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=spec["special"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(load_text()["train"]["text"][:n_docs], trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["user"]])
    if spec["bos"]:
        tok.post_processor = processors.TemplateProcessing(single=f"{spec['bos']} $A", pair=f"{spec['bos']} $A $B",
                                                           special_tokens=[(spec["bos"], tok.token_to_id(spec["bos"]))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spec["bos"], eos_token=spec["eos"],
                                   pad_token=spec["eos"])


def _config(family: str, vocab_size: int, bos: int | None, eos: int, shape: dict | None = None):
    import transformers

    ids = dict(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    dims = {**SHAPE, **(shape or {})}
    if family == "llama":
        return transformers.LlamaConfig(**dims, **ids, tie_word_embeddings=True, rope_theta=500_000.0,
                                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if family == "mistral":
        return transformers.MistralConfig(**dims, **ids, tie_word_embeddings=False, sliding_window=None,
                                          rope_theta=1_000_000.0)
    if family == "qwen2":
        return transformers.Qwen2Config(**dims, **ids, tie_word_embeddings=True, rope_theta=1_000_000.0)
    if family == "qwen3":
        return transformers.Qwen3Config(**{"head_dim": 32, **dims}, **ids, tie_word_embeddings=False, rope_theta=1_000_000.0,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0})
    raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")


FAMILIES = {"llama": "llama3", "mistral": "spm", "qwen2": "qwen2", "qwen3": "qwen2"}


def family_model(family: str, out: str | Path, tokenizer=None, seed: int = 0, steps: int = 12,
                 shape: dict | None = None) -> Path:
    """Save a seeded `family` model (SHAPE, updated by `shape`) with its tokenizer (built here unless given) to `out`,
    after `steps` of AdamW on
    the built-in corpus (4 x 128 tokens each). Why a few steps: at random init the next-token distribution is near
    uniform, so top-1 is decided by gaps smaller than Q8_0's rounding and agreement measures noise (measured on these
    shapes at init: 0.971-0.995 at Q8_0, 1.0 at F16); the steps make it peaked enough for agreement to mean something."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..models import load_tokenizer

    if tokenizer is None:
        tokenizer = load_tokenizer("tiny-gemma3") if FAMILIES[family] == "spm" else bpe_tokenizer(FAMILIES[family])
    cfg = _config(family, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    if steps:
        _fit(model, tokenizer, steps)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Path(out)


def _fit(model, tokenizer, steps: int) -> None:
    import torch

    from ..compress.evaluate import calibration_blocks

    blocks = calibration_blocks(tokenizer, 4 * steps, 128)  # the train split
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for i in range(steps):
        b = blocks[4 * i:][:4]
        model(input_ids=b, labels=b).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
