"""Models by name: the built-in tiny Gemma 3, a local transformers directory, or a hub name.

The built-in model needs no network: its config is defined here, its tokenizer ships in
hfscale/data/tokenizer, and its weights are a seeded random init (train it with the recipes).
Everything else goes through the same transformers calls with `trust_remote_code` off.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..util.errors import HfscaleError, first_line

TINY = "tiny-gemma3"


def tokenizer_dir() -> Path:
    return Path(str(resources.files("hfscale.models") / "data" / "tokenizer"))


def tiny_config():
    """A 3,001,920-parameter Gemma 3 text model that keeps the architecture's features:
    GQA (4 query / 2 key-value heads), local sliding-window layers mixed with a global one
    (Gemma's 5:1 pattern, shortened to 3:1), q/k norms, tied embeddings, GeGLU MLP."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=4096,
        hidden_size=192,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        query_pre_attn_scalar=48,
        max_position_embeddings=2048,
        sliding_window=64,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )


def tiny_gemma4_config():
    """A small Gemma 4 text config (not a built-in name; tests and proofs build it) with what sets Gemma 4 apart
    from uniform models, shaped like 31B: global layers with 1 K/V head of 64 against the sliding layers' 2 of
    32 (AmbiguousGlobalPerLayerAttributeError for code reading one num_key_value_heads / head_dim), keys as
    values there (attention_k_eq_v), sliding window 64, final logit soft-capping; the tiny tokenizer's vocabulary."""
    from transformers import Gemma4TextConfig

    S, F = "sliding_attention", "full_attention"
    return Gemma4TextConfig(vocab_size=4096, vocab_size_per_layer_input=4096, hidden_size=128, intermediate_size=512,
                            num_hidden_layers=4, layer_types=[S, F, S, F], num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=True,
                            hidden_size_per_layer_input=0, sliding_window=64, final_logit_softcapping=30.0,
                            max_position_embeddings=2048, pad_token_id=0, eos_token_id=1, bos_token_id=2)


BUILTIN = {TINY: tiny_config}


def dimension_configs() -> dict[str, Path]:
    """Published model shapes shipped as config.json files (dimensions only, no weights), so that
    planning works offline: gemma-3-270m, -1b, -4b, -12b, -27b and gemma-4-e2b, -e4b, -31b, -26b-a4b (text decoders)."""
    root = Path(str(resources.files("hfscale.models") / "data" / "models"))
    return {p.stem: p for p in sorted(root.glob("*.json"))}


def known_names() -> list[str]:
    return [*BUILTIN, *dimension_configs()]


def is_builtin(name: str) -> bool:
    return name in BUILTIN


def load_config(name_or_path: str):
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]()
    dims = dimension_configs()
    if name_or_path in dims:
        import json

        from transformers import AutoConfig

        data = json.loads(dims[name_or_path].read_text())
        return AutoConfig.for_model(data.get("model_type", "gemma3_text"), **{k: v for k, v in data.items() if k not in ("model_type", "architectures")})
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name_or_path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise HfscaleError(_not_found(name_or_path, e)) from None
    except StrictDataclassError as e:  # transformers checks field types: {"num_hidden_layers": "x"}
        detail = " ".join(ln.strip() for ln in str(e).strip().splitlines()[-1:])
        raise HfscaleError(f"model config {name_or_path} is invalid: {detail[:200]}; fix that field") from None
    except (ArithmeticError, TypeError) as e:  # a config class's own checks on nonsense values (0 heads: x % 0)
        raise HfscaleError(f"model config {name_or_path} is invalid ({type(e).__name__}: {str(e)[:200]}); "
                           "fix its sizes (attention heads, hidden size, layers must be positive)") from None


# any of these in a model directory means it carries a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def has_tokenizer(name_or_path: str) -> bool:
    """False only for a local directory without tokenizer files (a built-in or hub name may have one)."""
    path = Path(name_or_path).expanduser()
    return name_or_path in BUILTIN or not path.is_dir() or any((path / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    if not has_tokenizer(name_or_path):
        raise HfscaleError(f"{name_or_path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the tokenizer "
                           "files of the model it came from into it")
    source = str(tokenizer_dir()) if name_or_path in BUILTIN else name_or_path
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise HfscaleError(_not_found(name_or_path, e)) from None


def builtin_chat_template() -> str:
    """The built-in tokenizer's chat template, Gemma's turn format (<start_of_turn>role ... <end_of_turn>) in plain
    text: the tiny vocabulary has no ids for the markers, so each is a few ordinary tokens. Kept beside the
    tokenizer, not in it, so text-only uses of the tokenizer (export eval sets) are unchanged; the data layer
    gives it to the built-in tokenizer for conversational data (hfscale.data.formats)."""
    return (Path(str(resources.files("hfscale.models") / "data")) / "chat_template.jinja").read_text()


def build_model(name_or_path: str, seed: int = 0, dtype=None):
    """A causal LM: random (seeded) for a built-in name, pretrained weights (safetensors) otherwise."""
    import torch
    from transformers import AutoModelForCausalLM

    if name_or_path in BUILTIN:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(BUILTIN[name_or_path](), dtype=dtype)
        model.config.name_or_path = name_or_path
        return model
    try:
        return AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=dtype, use_safetensors=True, trust_remote_code=False
        )
    except (OSError, ValueError) as e:
        raise HfscaleError(_not_found(name_or_path, e)) from None


def load_for_eval(name_or_path: str, dtype=None):
    """(model in eval mode, tokenizer): what scoring, export and PTQ start from (fp32 unless `dtype`)."""
    import torch

    return build_model(name_or_path, dtype=dtype or torch.float32).eval(), load_tokenizer(name_or_path)


def _is_hub_name(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _not_found(name: str, err: Exception) -> str:
    """The one line for a model that did not load: what `name` is on disk decides what is said."""
    path = Path(name).expanduser()
    choices = f"give a built-in name ({', '.join(known_names())}) or a local transformers directory"
    if path.is_file():
        return f"{name} is a file, not a model; {choices}"
    if path.is_dir() and not (path / "config.json").is_file():
        return f"{name} is not a transformers model directory (no config.json in it); {choices}"
    first = first_line(err)
    if not path.exists():
        hub = f", and the hub did not give it ({first[:160]})" if _is_hub_name(name) else ""
        return f"model {name!r} not found: no such directory {name}{hub}; {choices}"
    return f"cannot load model {name!r} ({first[:160]}); {choices}, or a hub name with network access"


def save_pretrained_dir(name_or_path: str, out: str | Path, seed: int = 0) -> Path:
    """Write the model (safetensors), its config and its tokenizer as a transformers directory."""
    out = Path(out)
    model = build_model(name_or_path, seed=seed)
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(name_or_path).save_pretrained(out)
    return out
