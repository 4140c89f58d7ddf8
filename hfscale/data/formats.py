"""One record -> token ids and a loss mask, per format; the mask is computed from the rendered chat template.

Formats (FORMATS, detected from a record's columns; `format:` overrides):
- `text`: {"text": str} -> <bos> text <eos>, every token trained (train_on all).
- `messages`: {"messages": [{"role", "content"}, ...]} (system / user / assistant / tool), rendered with the
  tokenizer's chat template.
- `prompt_completion`: {"prompt", "completion"}, both strings (plain: <bos> prompt completion <eos>) or both
  message lists (conversational: rendered as one conversation).
- `tokenized`: {"input_ids": [...], "labels"?: [...]} (labels -100 where untrained, else equal to input_ids).

Masks (`train_on`, TRAIN_ON): `all`; `completion` (the completion, or for chats every assistant turn);
`assistant` (every assistant turn); `last` (the last assistant turn / the completion). A turn's tokens are
found from the template itself, not a `{% generation %}` tag: the conversation up to the turn is rendered with
the generation prompt and the conversation through the turn without it; the characters between the two are
the turn (its content and the template's terminator, Gemma's `<end_of_turn>`), and a token is trained when
its first character lies in a trained turn (the tokenizer's offset mapping). A template that does not
render prefixes of a conversation as prefixes of the whole is refused rather than guessed.

Checks on every example (`check_example`), refused in one line naming the example: one BOS (no doubled
BOS), each trained run ends with the turn terminator (or EOS), and the example has a trained token.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..util.errors import ConfigError, HfscaleError

FORMATS = {  # name -> the columns that identify it
    "text": ("text",),
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "tokenized": ("input_ids",),
}
TRAIN_ON = {
    "all": "every token (text's default)",
    "completion": "the completion / every assistant turn (prompt-completion's default)",
    "assistant": "every assistant turn (messages' default)",
    "last": "the last assistant turn / the completion",
}
DEFAULT_TRAIN_ON = {"text": "all", "messages": "assistant", "prompt_completion": "completion", "tokenized": "all"}
ROLES = ("system", "user", "assistant", "tool")


def detect(columns, where: str) -> str:
    """The format a record's columns say (text < messages < prompt+completion < input_ids by specificity)."""
    cols = set(columns)
    found = [name for name, need in FORMATS.items() if set(need) <= cols]
    if len(found) != 1:
        what = "none of" if not found else "several of"
        raise HfscaleError(f"{where}: columns {sorted(cols)} match {what} the formats "
                           f"({'; '.join(f'{k}: {list(v)}' for k, v in FORMATS.items())}); "
                           "give each record one format's columns, or set format:")
    return found[0]


@dataclass(frozen=True)
class Tok:
    """What the encoders need from a tokenizer, read once."""
    tokenizer: object
    bos: int | None
    eos: int | None
    terminator: str  # the text the chat template ends an assistant turn with ("" without a template)
    tail: int = 3  # tokens decoded at the end of a trained run to find the terminator (its length + 2)

    @classmethod
    def of(cls, tokenizer) -> "Tok":
        term = _template_terminator(tokenizer) if getattr(tokenizer, "chat_template", None) else ""
        n = len(tokenizer(term, add_special_tokens=False)["input_ids"]) if term else 1
        return cls(tokenizer, tokenizer.bos_token_id, tokenizer.eos_token_id, term, max(n, 1) + 2)

    @property
    def has_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))


def _template_terminator(tokenizer) -> str:
    """The text a template puts after an assistant turn's content (Gemma: <end_of_turn>), from a probe render."""
    conv = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "PROBE_ANSWER"}]
    full = tokenizer.apply_chat_template(conv, tokenize=False)
    return full[full.rfind("PROBE_ANSWER") + len("PROBE_ANSWER"):].strip()


def template_mask(tokenizer, messages, chat_template=None) -> tuple[list, list]:
    """A conversation rendered with the chat template (the tokenizer's, or `chat_template`): its token ids and, per
    token, whether the template wrote it, i.e. no character of it belongs to a message's content (turn markers, role
    names, separators, BOS). Contents are found in order in the rendering (the template may trim them)."""
    full = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=chat_template)
    spans, at = [], 0
    for m in messages:
        c = str(m["content"]).strip()
        s = full.find(c, at) if c else -1
        if s >= 0:
            spans.append((s, s + len(c)))
            at = s + len(c)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    return enc["input_ids"], [not any(a < e and s < b for a, b in spans) for s, e in enc["offset_mapping"]]


def template_token_ids(tokenizer, chat_template=None) -> tuple[int, ...]:
    """The token ids a chat template writes around the contents (template_mask over a probe conversation of a system,
    a user and an assistant turn; user and assistant only where the template refuses a system turn): the rows a LoRA
    run trains with `trainable_tokens: template` (hfscale.scale.adapters.AdapterSpec), since a base pre-trained on
    plain text never learnt them. Sorted, each once."""
    from jinja2 import TemplateError

    turns = [{"role": "user", "content": "PROBE QUESTION"}, {"role": "assistant", "content": "PROBE ANSWER"}]
    for conv in ([{"role": "system", "content": "PROBE SYSTEM"}] + turns, turns):
        try:
            ids, mask = template_mask(tokenizer, conv, chat_template)
        except TemplateError:  # a template that raises on a system turn (raise_exception): try without it
            continue
        except Exception as e:  # noqa: BLE001 - the template's own code failed (not a refusal): one line, as _chat says it
            raise HfscaleError(f"the chat template failed on a probe conversation ({str(e).splitlines()[0][:160]}); fix "
                               "the template, or name the trainable tokens by id") from None
        return tuple(sorted({i for i, m in zip(ids, mask) if m}))
    raise HfscaleError("the chat template refused a user / assistant conversation; give the tokenizer a chat template "
                       "that renders one, or name the trainable tokens by id")


@dataclass
class Encoded:
    ids: list
    mask: list  # 1 = trained
    chat: bool | None = False  # True: turns end on the template's terminator; False: on EOS; None: either
    checked: bool = True  # False: pre-tokenized data without labels (no turns to check)


def encode(record: dict, fmt: str, tok: Tok, train_on: str, where: str) -> Encoded:
    need = FORMATS[fmt]
    missing = [c for c in need if c not in record]
    if missing:
        raise HfscaleError(f"{where}: no {missing[0]!r} column for format {fmt} (columns: {sorted(record)})")
    return ENCODERS[fmt](record, tok, train_on, where)


def _text(record, tok: Tok, train_on, where) -> Encoded:
    text = record["text"]
    if not isinstance(text, str):
        raise HfscaleError(f"{where}: 'text' holds {type(text).__name__}, not a string; give each record a \"text\": \"...\"")
    ids = _wrap(tok, tok.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    return Encoded(ids, [1] * len(ids))


def _wrap(tok: Tok, body: list) -> list:
    return ([tok.bos] if tok.bos is not None else []) + list(body) + ([tok.eos] if tok.eos is not None else [])


def _prompt_completion(record, tok: Tok, train_on, where) -> Encoded:
    p, c = record["prompt"], record["completion"]
    if isinstance(p, list) and isinstance(c, list):  # conversational: one conversation, the completion's turns trained
        return _chat(p + c, tok, "all" if train_on == "all" else "from", where, first=len(p), last=train_on == "last")
    if not (isinstance(p, str) and isinstance(c, str)):
        raise HfscaleError(f"{where}: prompt and completion must both be strings or both lists of messages "
                           f"(got {type(p).__name__} and {type(c).__name__})")
    pi = tok.tokenizer(p, add_special_tokens=False)["input_ids"]
    ci = tok.tokenizer(c, add_special_tokens=False)["input_ids"]
    ids = _wrap(tok, pi + ci)
    head = 1 if tok.bos is not None else 0
    mask = [1] * len(ids) if train_on == "all" else [0] * (head + len(pi)) + [1] * (len(ids) - head - len(pi))
    return Encoded(ids, mask)


def _messages(record, tok: Tok, train_on, where) -> Encoded:
    return _chat(record["messages"], tok, "all" if train_on == "all" else "assistant", where, last=train_on == "last")


def _chat(conv, tok: Tok, mode: str, where: str, first: int = 0, last: bool = False) -> Encoded:
    """mode: all | assistant (every assistant turn) | from (assistant turns at index >= first)."""
    if not tok.has_template:
        raise HfscaleError(f"{where}: conversational data needs a chat template, and this tokenizer has none; give the model "
                           "directory a chat_template (tokenizer_config.json or chat_template.jinja), or use text data")
    if not isinstance(conv, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in conv):
        raise HfscaleError(f"{where}: messages must be a list of {{\"role\": ..., \"content\": ...}} objects")
    bad = [m["role"] for m in conv if m["role"] not in ROLES]
    if bad:
        raise HfscaleError(f"{where}: role {bad[0]!r} is not one of {', '.join(ROLES)}")
    render = tok.tokenizer.apply_chat_template
    try:
        full = render(conv, tokenize=False)
    except Exception as e:  # a jinja error raised by the user's template (raise_exception in the template)
        raise HfscaleError(f"{where}: the chat template refused this conversation ({str(e).splitlines()[0][:160]})") from None
    spans = []
    turns = [i for i, m in enumerate(conv) if m["role"] == "assistant" and (mode != "from" or i >= first)]
    if last and turns:
        turns = turns[-1:]
    if mode != "all":
        for i in turns:
            a = render(conv[:i], tokenize=False, add_generation_prompt=True) if i else ""
            b = render(conv[: i + 1], tokenize=False)
            if not (full.startswith(a) and full.startswith(b) and len(a) <= len(b)):
                raise HfscaleError(f"{where}: the chat template does not render the start of a conversation as the start of "
                                   "the whole (it rewrites earlier turns), so the assistant turns cannot be found; use "
                                   "train_on: all or a template that renders turn by turn")
            spans.append((len(a), len(b)))
    enc = tok.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    if mode == "all":
        mask = [1] * len(ids)
    else:
        mask = [int(any(a <= s < b for a, b in spans)) for s, _ in offsets]
    if tok.bos is not None and (not ids or ids[0] != tok.bos):  # a template without {{ bos_token }}
        ids, mask = [tok.bos] + ids, [0] + mask
    return Encoded(ids, mask, chat=True)


def _tokenized(record, tok: Tok, train_on, where) -> Encoded:
    ids = record["input_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise HfscaleError(f"{where}: input_ids must be a list of integers")
    vocab = len(tok.tokenizer)
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        raise HfscaleError(f"{where}: input_ids hold {max(ids)} / {min(ids)}, outside the tokenizer's {vocab:,} ids")
    labels = record.get("labels")
    if labels is None:
        return Encoded(list(ids), [1] * len(ids), checked=False)
    if len(labels) != len(ids) or any(lab not in (-100, i) for lab, i in zip(labels, ids)):
        raise HfscaleError(f"{where}: labels must have input_ids' length and hold -100 (untrained) or the same id "
                           "(unshifted, as transformers' models shift them)")
    return Encoded(list(ids), [0 if lab == -100 else 1 for lab in labels], chat=None)


ENCODERS = {"text": _text, "messages": _messages, "prompt_completion": _prompt_completion, "tokenized": _tokenized}


def check_train_on(fmt: str | None, train_on: str | None) -> None:
    if train_on is not None and train_on not in TRAIN_ON:
        raise ConfigError(f"train_on {train_on!r} not understood; use one of {', '.join(TRAIN_ON)}")
    if fmt is not None and fmt not in FORMATS:
        raise ConfigError(f"format {fmt!r} not understood; use one of {', '.join(FORMATS)} (or leave it out: detected)")
    if fmt in ("text", "tokenized") and train_on not in (None, "all"):
        raise ConfigError(f"train_on {train_on} needs turns to choose from; {fmt} data trains on all its tokens "
                          "(use messages or prompt/completion data)")


def check_example(enc: Encoded, tok: Tok, where: str) -> None:
    """Before training: one BOS, each trained run ends on the terminator, some token trained. One line each."""
    ids, mask = enc.ids, enc.mask
    if len(ids) != len(mask):
        raise HfscaleError(f"{where}: {len(ids)} tokens but {len(mask)} mask entries; the mask must line up with the tokens")
    if tok.bos is not None and len(ids) > 1 and ids[0] == tok.bos and ids[1] == tok.bos:
        raise HfscaleError(f"{where}: the example starts with a doubled BOS (the template writes one and one more is "
                           "added); drop {{ bos_token }} from the template or the BOS from the data")
    if not any(mask):
        raise HfscaleError(f"{where}: no token of this example is trained (an empty loss mask: no assistant turn or "
                           "completion); fix the example or use train_on: all")
    if enc.chat and enc.checked and not tok.terminator:
        raise HfscaleError(f"{where}: the chat template writes nothing after an assistant turn (no end-of-turn marker, no "
                           "EOS), so the model cannot learn to stop; use a template that ends each turn")
    eos = [tok.tokenizer.convert_ids_to_tokens(tok.eos)] if tok.eos is not None else []
    terms = [t for t in ([tok.terminator] if enc.chat else eos if enc.chat is False else [tok.terminator, *eos]) if t]
    if enc.checked and terms:
        n = tok.tail
        for end in ([len(mask)] if all(mask) else _run_ends(mask)):
            # text, not ids: BPE may merge the terminator with what follows ("turn>" + "\n" -> ">\n")
            tail = tok.tokenizer.decode(ids[max(0, end - n): end]).rstrip()
            if not any(tail.endswith(t) for t in terms):
                raise HfscaleError(f"{where}: a trained turn ends without its terminator {terms[0]!r} trained, so the model "
                                   "never learns to stop; train the terminator (its tokens' labels) with the turn")


def _run_ends(mask) -> list[int]:
    """End indices (exclusive) of the maximal runs of trained tokens."""
    return [i + 1 for i, m in enumerate(mask) if m and (i + 1 == len(mask) or not mask[i + 1])]


def data_tokenizer(model: str):
    """The model's tokenizer for data: the built-in one gets its Gemma-style chat template
    (hfscale.models.builtin.builtin_chat_template); others keep their own."""
    from ..models.builtin import builtin_chat_template, is_builtin, load_tokenizer

    tokenizer = load_tokenizer(model)
    if is_builtin(model) and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = builtin_chat_template()
    return tokenizer
