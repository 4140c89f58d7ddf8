"""GGUF export of the trained tiny Gemma 3, checked in llama.cpp itself (and transformers' reader)."""

import json

import gguf
import pytest

from hfscale.util.errors import HfscaleError
from hfscale.export import FORMATS
from hfscale.export.evalset import EvalSet

ES = EvalSet(n_prompts=4, prompt_tokens=96, ppl_blocks=4, seq_len=128)


@pytest.fixture(scope="session")
def trained():
    from hfscale.testing.trained import trained_tiny

    return str(trained_tiny())


@pytest.fixture(scope="session")
def exports(trained, tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    return {q: FORMATS["gguf"].export(trained, d / f"m-{q}.gguf", q, False, evalset=ES, progress=False)
            for q in ("F16", "Q8_0", "Q4_0")}


def test_registry_contract():
    f = FORMATS["gguf"]
    assert f.qtypes == ("F16", "BF16", "Q8_0", "Q4_0") and f.default_qtype in f.qtypes


def test_f16_matches_transformers_in_llama_cpp(exports):
    v = exports["F16"]["verification"]
    # 4 held-out prompts, 5 probe texts, 4 texts with one added token each (<pad> <eos> <bos> <unk>), all in a row
    assert v["tokenizer"] == {"texts": 14, "identical": 14}
    assert v["vs_transformers"]["top1_agreement"] == 1.0
    assert v["vs_transformers"]["max_abs_dlogit"] < 0.02  # measured 0.003: fp16 weights only
    assert v["vs_transformers"]["positions"] == 4 * 96
    assert abs(v["perplexity"] / v["perplexity_transformers_fp32"] - 1) < 1e-3
    # transformers reads the weights back; its gemma3 GGUF config mapping drops the layer pattern
    tr = v["transformers_gguf_reload"]
    assert tr["source_config"]["max_abs_dlogit"] < 0.02
    assert "layer_types" in tr["as_read"]["config_differences"]


def test_quantized_quality_and_sizes(exports):
    n = exports["F16"]["source"]["parameters"]
    sizes = {q: r["bytes"] for q, r in exports.items()}
    # F16: 2 bytes/param (+ F32 norms, + ~100 KB of vocab metadata)
    assert 2 * n < sizes["F16"] < 2 * n + 300_000
    # Q8_0 = 34 bytes / 32 weights; Q4_0 = 18 / 32 on the linears, embedding kept at Q8_0
    assert sizes["Q4_0"] < sizes["Q8_0"] < 0.6 * sizes["F16"]
    for q, floor in (("Q8_0", 0.99), ("Q4_0", 0.9)):
        v = exports[q]["verification"]
        assert v["vs_transformers"]["top1_agreement"] >= floor, q
        assert abs(v["perplexity"] / v["perplexity_transformers_fp32"] - 1) < 0.05, q
    assert exports["Q4_0"]["scheme"]["tensor_types"] == {"Q8_0": 1, "Q4_0": 28, "F32": 25}


def test_sidecar_and_file_metadata(exports):
    r = exports["Q4_0"]
    side = json.loads(open(r["out"] + ".json").read())
    assert side["bytes"] == r["bytes"] and side["scheme"]["token_embedding_qtype"] == "Q8_0"
    assert side["verification"]["perplexity"] == r["verification"]["perplexity"]
    rd = gguf.GGUFReader(r["out"])
    f = rd.fields
    assert bytes(f["general.architecture"].parts[-1]).decode() == "gemma3"
    assert list(f["gemma3.attention.sliding_window_pattern"].parts[-4:]) == [[1], [1], [1], [0]]
    assert "output.weight" not in {t.name for t in rd.tensors}  # tied: llama.cpp reuses token_embd


def test_embedding_type_option(trained, tmp_path):
    r = FORMATS["gguf"].export(trained, tmp_path / "e.gguf", "Q4_0", False, embed_qtype="F16", verify=False,
                               progress=False)
    assert r["scheme"]["tensor_types"] == {"F16": 1, "Q4_0": 28, "F32": 25}
    assert "verification" not in r


def test_refusals_write_nothing(trained, tmp_path):
    out = tmp_path / "x.gguf"
    with pytest.raises(HfscaleError, match="F16, BF16, Q8_0, Q4_0"):
        FORMATS["gguf"].export(trained, out, "Q5_K", False)
    from transformers import GPTNeoXConfig

    GPTNeoXConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
                  vocab_size=256).save_pretrained(tmp_path / "neox")
    with pytest.raises(HfscaleError, match="supports model types gemma3_text, gemma4_text, llama, mistral, qwen2, qwen3 .*'gpt_neox'"):
        FORMATS["gguf"].export(str(tmp_path / "neox"), out, "Q4_0", False)
    assert list(tmp_path.glob("x.gguf*")) == []
    out.write_text("keep")
    with pytest.raises(HfscaleError, match="--force"):
        FORMATS["gguf"].export(trained, out, "Q4_0", False)
    assert out.read_text() == "keep"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# --- added tokens that are not special (Gemma's chat markers in many checkpoints) ------------------

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
                 "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """`hfscale tiny --out DIR`, its tokenizer given <start_of_turn>/<end_of_turn> as user-defined
    (non-special) added tokens and a Gemma-style chat template, the embedding resized to match."""
    from conftest import run_cli
    from transformers import AddedToken, AutoModelForCausalLM, AutoTokenizer

    d = tmp_path_factory.mktemp("chat") / "tiny_chat"
    assert run_cli("tiny", "--out", d).returncode == 0
    tok = AutoTokenizer.from_pretrained(d)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<start_of_turn>", "<end_of_turn>")])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.save_pretrained(d)
    return d


def test_user_defined_tokens_and_chat_text_tokenize_as_in_transformers(chat_model, tmp_path):
    from transformers import AutoTokenizer

    from hfscale.export.evalset import CHAT
    from hfscale.export.verify_llama import open_llama

    tok = AutoTokenizer.from_pretrained(chat_model)
    assert {t.content: t.special for i, t in tok.added_tokens_decoder.items() if i >= 4096} == {
        "<start_of_turn>": False, "<end_of_turn>": False}
    out = tmp_path / "chat.gguf"
    rec = FORMATS["gguf"].export(str(chat_model), out, "F16", False, evalset=ES, progress=False)
    # 4 prompts + 5 probe texts + 6 texts with one added token each + all in a row + the chat template applied
    assert rec["verification"]["tokenizer"] == {"texts": 17, "identical": 17}
    T = gguf.TokenType
    types = gguf.GGUFReader(out).fields["tokenizer.ggml.token_type"]
    types = [int(types.parts[i][0]) for i in types.data]
    assert [types[i] for i in (0, 1, 2, 4096, 4097)] == [T.CONTROL, T.CONTROL, T.CONTROL, T.USER_DEFINED, T.USER_DEFINED]
    chat = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    want = tok(chat, add_special_tokens=False).input_ids
    assert want.count(4096) == 4 and want.count(4097) == 3  # the markers are single tokens in transformers
    with open_llama(out, n_ctx=256) as llm:
        assert llm.tokenize(chat.encode(), add_bos=False, special=True) == want


def test_the_tokenizer_check_catches_markers_written_as_normal(chat_model, tmp_path, monkeypatch):
    """What the export wrote before: only special added tokens known, the rest NORMAL. llama.cpp then
    splits <start_of_turn> into pieces (measured: 13 of 16 texts alike; all 3 others hold it; 5 probe texts added since)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfscale.export import evalset as E
    from hfscale.export import gguf as G
    from hfscale.export.verify_llama import check_tokenizer, open_llama

    tok = AutoTokenizer.from_pretrained(chat_model)
    model = AutoModelForCausalLM.from_pretrained(chat_model).float().eval()
    real = G.added_tokens
    monkeypatch.setattr(G, "added_tokens", lambda t: {k: v for k, v in real(t).items() if v})
    out = tmp_path / "normal.gguf"
    G.write_gguf(model, tok, out, G.GGUFOptions("F16"), progress=False)
    with open_llama(out, n_ctx=256) as llm:
        r = check_tokenizer(llm, tok, E.tokenizer_texts(tok, ES))
    assert r["identical"] < r["texts"] == 17
    assert all("<start_of_turn>" in t for t in r["differing_texts"])
