"""Byte-level BPE tokenizers (GPT-2 / Llama 3 / Qwen style) as llama.cpp's "gpt2" vocabulary.

llama.cpp splits text with a pre-tokenizer regex chosen by the GGUF key `tokenizer.ggml.pre`, then runs BPE
merges over GPT-2's byte-to-unicode alphabet. Its own converter picks that name from a hash of how the
tokenizer splits a fixed text, so a tokenizer it has not seen (any locally trained one) is refused. Here the
name comes from the tokenizer's structure instead: tokenizer.json's pre_tokenizer is read, and its split
regex is looked up among the regexes llama.cpp implements (src/llama-vocab.cpp, `llm_tokenizer_bpe`, whose
comments quote each one as it appears in tokenizer.json). The merge rule has to match too: with
`ignore_merges` a word that is itself in the vocabulary is emitted whole (Llama 3); llama.cpp does that for
the llama3 pre-tokenizer only. Anything else (another regex, a normalizer that changes text, added tokens
that strip spaces) is refused in one line: llama.cpp would split differently.

NFC normalization (Qwen's tokenizers) is accepted: llama.cpp does not normalize, so the two agree on text
that is already NFC (what the probe set holds); a decomposed accent would be tokenized differently.
"""

from __future__ import annotations

from ..util.errors import HfscaleError

# tokenizer.json's Split regex -> (llama.cpp pre-tokenizer name, the ignore_merges llama.cpp applies with it)
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_REGEXES = {LLAMA3_REGEX: ("llama-bpe", True), QWEN2_REGEX: ("qwen2", False)}
GPT2 = ("gpt-2", False)  # ByteLevel(use_regex=True): GPT-2's own regex, built into the pre-tokenizer
KNOWN = "Llama 3 (llama-bpe), Qwen 2/3 (qwen2), GPT-2 (gpt-2)"
NORMALIZERS = (None, "NFC")


def is_byte_level(tokenizer_json: dict) -> bool:
    m = tokenizer_json.get("model", {})
    return m.get("type") == "BPE" and not m.get("byte_fallback") and "ByteLevel" in _kinds(tokenizer_json.get("decoder"))


def _kinds(node) -> list[str]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [k for sub in node.get("pretokenizers", node.get("decoders", node.get("normalizers", []))) for k in _kinds(sub)]
    return [node["type"]]


def _refuse(what: str) -> HfscaleError:
    return HfscaleError(f"tokenizer: {what}; llama.cpp would tokenize differently, so it is not exported to GGUF "
                        f"(byte-level BPE pre-tokenizers known: {KNOWN})")


def pre_tokenizer(tokenizer_json: dict) -> tuple[str, bool]:
    """(llama.cpp pre-tokenizer name, ignore_merges it applies) for this tokenizer.json, or refuse."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex", True):
        found = GPT2
        last = steps[0]
    elif (len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel"
          and not steps[1].get("use_regex", True)):
        split = steps[0]
        rx = (split.get("pattern") or {}).get("Regex")
        if split.get("behavior") != "Isolated" or split.get("invert"):
            raise _refuse(f"pre_tokenizer Split behavior={split.get('behavior')!r} invert={split.get('invert')}")
        if rx not in SPLIT_REGEXES:
            raise _refuse(f"pre_tokenizer regex {rx!r} is not one llama.cpp implements")
        found = SPLIT_REGEXES[rx]
        last = steps[1]
    else:
        raise _refuse(f"pre_tokenizer {'+'.join(_kinds(pre)) or 'none'}")
    if last.get("add_prefix_space"):
        raise _refuse("ByteLevel add_prefix_space=True")
    norm = tokenizer_json.get("normalizer")
    if (norm or {}).get("type") not in NORMALIZERS:
        raise _refuse(f"normalizer {'+'.join(_kinds(norm))}")
    ignore = bool(tokenizer_json["model"].get("ignore_merges", False))
    if ignore != found[1]:
        raise _refuse(f"ignore_merges={ignore} with the {found[0]} pre-tokenizer (llama.cpp uses {found[1]})")
    return found


def check(tokenizer_json: dict) -> str:
    """Everything that refuses a byte-level tokenizer; returns the llama.cpp pre-tokenizer name."""
    name, _ = pre_tokenizer(tokenizer_json)
    for t in tokenizer_json.get("added_tokens", []):
        for flag in ("lstrip", "rstrip", "single_word"):
            if t.get(flag):
                raise _refuse(f"added token {t['content']!r} has {flag}=True")
    return name


def add_vocab(w, tokenizer, tokenizer_json: dict, added: dict[str, bool], n_vocab: int) -> str:
    """Write the "gpt2" vocabulary: tokens in id order (unused embedding rows as [PADi], UNUSED), merges,
    types (CONTROL for special added tokens, USER_DEFINED for the others: llama.cpp then matches them whole,
    as transformers does), the pre-tokenizer name. Returns that name."""
    import gguf

    name = check(tokenizer_json)
    model = tokenizer_json["model"]
    vocab = dict(model["vocab"])
    for t in tokenizer_json.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
    n = max(vocab.values()) + 1
    if n > n_vocab:
        raise HfscaleError(f"the tokenizer has ids up to {n - 1} but the model's embedding has {n_vocab} rows; "
                           "resize it (model.resize_token_embeddings(len(tokenizer))) and save the model again")
    T = gguf.TokenType
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [T.UNUSED] * n_vocab
    for s, i in vocab.items():
        tokens[i] = s
        types[i] = (T.CONTROL if added[s] else T.USER_DEFINED) if s in added else T.NORMAL
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(name)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    return name
