"""The embedded default: tiny Gemma 3, its tokenizer and the corpus, all offline."""

import os

import pytest
import torch


def test_tokenizer_round_trips_and_uses_gemma_ids():
    from hfscale.models import load_tokenizer

    tok = load_tokenizer("tiny-gemma3")
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == 4096
    text = "The assert statement — naïve café 😀 x**2 != y\n\tindented"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.unk_token_id not in ids  # byte fallback: nothing is unknown
    assert tok.decode(ids) == text
    # it compresses real prose (a learned vocabulary, not bytes)
    prose = "Assert statements are a convenient way to insert debugging assertions into a program."
    assert len(tok(prose, add_special_tokens=False).input_ids) < len(prose) / 3


def test_corpus_is_real_text_with_a_disjoint_held_out_split():
    from hfscale.data.corpus import load_text

    ds = load_text()
    train, val = ds["train"], ds["validation"]
    assert len(train) == 2152 and len(val) == 111
    assert sum(len(t) for t in train["text"]) > 1_500_000
    assert not set(train["text"]) & set(val["text"])
    words = " ".join(val["text"]).split()
    common = {"the", "a", "is", "of", "to", "and"}
    assert sum(w.lower() in common for w in words) / len(words) > 0.08  # English prose, not random tokens


def test_user_text_file_goes_through_the_same_path(tmp_path):
    from hfscale.data.corpus import load_text

    f = tmp_path / "my.txt"
    f.write_text("\n".join(f"line {i} of my own text" for i in range(100)))
    ds = load_text(str(f))
    assert len(ds["train"]) + len(ds["validation"]) == 100 and len(ds["validation"]) == 5


def test_packed_blocks_shape_and_boundaries():
    from hfscale.data.corpus import packed_blocks
    from hfscale.models import load_tokenizer

    tok = load_tokenizer("tiny-gemma3")
    b = packed_blocks(tok, ["one two three", "four five"], 4)
    assert b.dtype == torch.long and b.shape[1] == 4
    flat = b.flatten().tolist()
    assert flat[0] == tok.bos_token_id and tok.eos_token_id in flat


def test_tiny_model_is_gemma3_with_its_features():
    from hfscale.models import build_model

    m = build_model("tiny-gemma3")
    c = m.config
    assert c.model_type == "gemma3_text" and type(m).__name__ == "Gemma3ForCausalLM"
    n = sum(p.numel() for p in m.parameters())
    assert 2_000_000 < n < 5_000_000 and n == 3_001_920
    assert c.num_key_value_heads < c.num_attention_heads  # GQA
    assert set(c.layer_types) == {"sliding_attention", "full_attention"}
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()  # tied
    # seeded: the same weights every time
    m2 = build_model("tiny-gemma3")
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


def test_tiny_saves_in_transformers_format_and_reloads_offline(tmp_path, cli):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfscale.models import build_model

    assert os.environ["HF_HUB_OFFLINE"] == "1"
    out = tmp_path / "tiny"
    r = cli("tiny", "--out", out)
    assert r.returncode == 0, r.stderr
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert cli("tiny", "--out", out).returncode == 2  # no overwrite without --force
    m = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The yield statement", return_tensors="pt").input_ids
    ref = build_model("tiny-gemma3")
    with torch.no_grad():
        assert torch.allclose(m(ids).logits, ref(ids).logits, atol=1e-5)
    # a local path goes through the same loaders as a built-in name
    from hfscale.models import build_model as bm

    assert sum(p.numel() for p in bm(str(out)).parameters()) == 3_001_920


def test_unknown_model_is_a_clear_error():
    from hfscale.util.errors import HfscaleError
    from hfscale.models import load_config

    with pytest.raises(HfscaleError, match="built-in name"):
        load_config("/no/such/model")


def test_the_shipped_trained_model_is_the_fixture_and_has_learnt(tmp_path):
    """hfscale/models/data/trained (tools/build_trained_tiny.py): the default TinyTraining's result in bf16. The
    fixture copies it as fp32 (no training in a test run); it scores on the held-out text what was recorded when it
    was made (the bf16 weights upcast exactly, so only the kernels' fp32 rounding differs: 1e-3 of a loss ~4.9 is
    ~100x that), far below the random init's ~8.3 (ln 4096)."""
    import json

    from safetensors.torch import load_file

    from hfscale.testing.trained import TinyTraining, shipped_dir, trained_tiny, val_loss

    info = json.loads((shipped_dir() / "hfscale_training.json").read_text())
    assert info["recipe_key"] == TinyTraining().key() and info["shipped_dtype"] == "bfloat16"
    d = trained_tiny(cache=tmp_path, progress=False)
    weights = load_file(d / "model.safetensors")
    assert len(weights) == 54 and all(v.dtype == torch.float32 for v in weights.values())
    assert sum(v.numel() for v in weights.values()) == 3_001_920
    assert (d / "tokenizer.json").is_file() and json.loads((d / "hfscale_training.json").read_text()) == info
    got = val_loss(d)
    assert abs(got - info["val_loss_first_64_blocks_shipped"]) < 1e-3 and got < 5.5
