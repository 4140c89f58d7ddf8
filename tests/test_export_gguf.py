"""GGUF export of the trained tiny Gemma 3, checked in llama.cpp itself (and transformers' reader)."""

import json

import gguf
import pytest

from hfscale.errors import HfscaleError
from hfscale.export import FORMATS
from hfscale.export.evalset import EvalSet

ES = EvalSet(n_prompts=4, prompt_tokens=96, ppl_blocks=4, seq_len=128)


@pytest.fixture(scope="session")
def trained():
    from hfscale.pretrained import trained_tiny

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
    assert v["tokenizer"] == {"texts": 4, "identical": 4}
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
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
                vocab_size=256).save_pretrained(tmp_path / "llama")
    with pytest.raises(HfscaleError, match="supports model types gemma3_text"):
        FORMATS["gguf"].export(str(tmp_path / "llama"), out, "Q4_0", False)
    assert list(tmp_path.glob("x.gguf*")) == []
    out.write_text("keep")
    with pytest.raises(HfscaleError, match="--force"):
        FORMATS["gguf"].export(trained, out, "Q4_0", False)
    assert out.read_text() == "keep"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
