"""GGUF export of the non-Gemma families `hfscale prune` supports (Llama 3.x, Mistral, Qwen 2, Qwen 3), checked in
llama.cpp itself against transformers: logits, top-1, perplexity, and tokenization of held-out text, the PROBE texts
and every added token; a peft LoRA adapter as a llama.cpp adapter GGUF equals the merged model; what llama.cpp would
compute differently is refused in one line with nothing written.

Models: hfscale.testing.families (2 layers, hidden 64, the family's features, 12 AdamW steps so that top-1 is not
decided by rounding noise), tokenizers trained here with each family's real pre-tokenizer."""

import json
import os

import gguf
import pytest

from hfscale.export import FORMATS, export_gguf_adapter
from hfscale.export.evalset import PROBE, EvalSet
from hfscale.testing.families import FAMILIES, bpe_tokenizer, family_model
from hfscale.util.errors import HfscaleError

ES = EvalSet(n_prompts=3, prompt_tokens=64, ppl_blocks=2, seq_len=64)


@pytest.fixture(scope="module")
def tokenizers():
    return {"llama3": bpe_tokenizer("llama3"), "qwen2": bpe_tokenizer("qwen2"), "spm": None}


@pytest.fixture(scope="module")
def models(tokenizers, tmp_path_factory):
    d = tmp_path_factory.mktemp("families")
    return {f: family_model(f, d / f, tokenizer=tokenizers[kind]) for f, kind in FAMILIES.items()}


def _field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else bytes(f.parts[-1]).decode()


# what each family's file must hold beyond the common tensors: (arch, pre-tokenizer, extra tensor, head untied)
EXPECT = {"llama": ("llama", "llama-bpe", "rope_freqs.weight", False),
          "mistral": ("llama", None, None, True),
          "qwen2": ("qwen2", "qwen2", "blk.0.attn_q.bias", False),
          "qwen3": ("qwen3", "qwen2", "blk.0.attn_q_norm.weight", True)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_exports_run_in_llama_cpp_as_in_transformers(family, models, tmp_path):
    umask = os.umask(0)
    os.umask(umask)
    recs = {q: FORMATS["gguf"].export(str(models[family]), tmp_path / f"{family}-{q}.gguf", q, False, evalset=ES,
                                      progress=False, reload=False) for q in ("F16", "Q8_0", "Q4_0")}
    for q, rec in recs.items():
        v = rec["verification"]
        tk = v["tokenizer"]
        # held-out prompts, PROBE, one text per added token (+ all of them in a row), each split exactly alike
        assert tk["identical"] == tk["texts"] >= ES.n_prompts + len(PROBE) + 2, (q, tk)
        assert v["vs_transformers"]["positions"] == ES.n_prompts * ES.prompt_tokens
        assert os.stat(rec["out"]).st_mode & 0o777 == 0o666 & ~umask  # as the other exports: the umask's mode
    f16, q8, q4 = (recs[q]["verification"] for q in ("F16", "Q8_0", "Q4_0"))
    # F16: only the weights are rounded (2^-11 relative); measured max |dlogit| <= 6e-4 on all four, top-1 1.0.
    # A wrong q/k row order (llama arch), rope kind, bias, norm or head shows as O(0.1-1) logit errors.
    assert f16["vs_transformers"]["top1_agreement"] == 1.0 and f16["vs_transformers"]["max_abs_dlogit"] < 0.01
    assert abs(f16["perplexity"] / f16["perplexity_transformers_fp32"] - 1) < 1e-3
    assert q8["vs_transformers"]["top1_agreement"] >= 0.97
    assert abs(q8["perplexity"] / q8["perplexity_transformers_fp32"] - 1) < 0.01
    assert abs(q4["perplexity"] / q4["perplexity_transformers_fp32"] - 1) < 0.1
    arch, pre, extra, untied = EXPECT[family]
    rd = gguf.GGUFReader(recs["Q8_0"]["out"])
    names = {t.name for t in rd.tensors}
    assert _field(rd, "general.architecture") == arch and _field(rd, "tokenizer.ggml.pre") == pre
    assert ("output.weight" in names) == untied and (extra is None or extra in names)
    assert _field(rd, "tokenizer.ggml.model") == ("llama" if pre is None else "gpt2")


def test_probe_catches_a_wrong_pre_tokenizer(models, tmp_path, monkeypatch):
    """The Qwen tokenizer written under GPT-2's pre-tokenizer name: llama.cpp splits text otherwise, and the
    tokenizer check says so (what a wrong pre-tokenizer name would otherwise do silently)."""
    from hfscale.export import evalset as E
    from hfscale.export import gguf_bpe
    from hfscale.export.gguf import GGUFOptions, write_gguf
    from hfscale.export.verify_llama import check_tokenizer, open_llama
    from hfscale.models.builtin import load_for_eval

    monkeypatch.setitem(gguf_bpe.SPLIT_REGEXES, gguf_bpe.QWEN2_REGEX, ("gpt-2", False))
    m, tok = load_for_eval(str(models["qwen2"]))
    write_gguf(m, tok, tmp_path / "wrong.gguf", GGUFOptions("F16"), progress=False)
    with open_llama(tmp_path / "wrong.gguf", n_ctx=256) as llm:
        r = check_tokenizer(llm, tok, E.tokenizer_texts(tok, ES))
        # measured: the code text differs ("):\n" is one pre-token under Qwen's regex, two under GPT-2's); with this
        # 1,024-token vocabulary the other PROBE texts' differing splits merge back to the same tokens
        assert check_tokenizer(llm, tok, PROBE)["identical"] < len(PROBE)
    assert r["identical"] < r["texts"]


def _lora(model_dir, out, **cfg):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                        LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj",
                                                                                   "o_proj", "gate_proj", "up_proj",
                                                                                   "down_proj"], **cfg}))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:  # peft initializes B to zero: an adapter that changes nothing
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(out)
    return out


def test_lora_adapter_gguf_equals_the_merged_model(models, tmp_path):
    """Llama (the arch whose q/k rows are permuted, so lora_B of q/k must be too), rsLoRA scale."""
    adapter = _lora(models["llama"], tmp_path / "lora", use_rslora=True)
    out = tmp_path / "lora.gguf"
    rec = export_gguf_adapter(str(models["llama"]), adapter, out, progress=False, evalset=ES)
    v = rec["verification"]
    # base F16 + F32 adapter in llama.cpp vs fp32 merged weights: the only rounding is the base's F16 weights, the
    # floor `base_alone` measures (5e-4 measured); the adapter's own product is F32. 2x the floor + 1e-4 allows for
    # the adapter moving activations; the adapter itself moves logits by ~1 (measured 1.06 at scale 2): 1000x more.
    m, floor = v["vs_merged_transformers"], v["base_alone_vs_transformers"]
    assert m["max_abs_dlogit"] < 2 * floor["max_abs_dlogit"] + 1e-4 and m["top1_agreement"] == 1.0
    assert v["adapter_effect_max_abs_dlogit"] > 100 * m["max_abs_dlogit"]
    assert rec["scheme"]["scale"] == pytest.approx(16 / 8 ** 0.5) and rec["scheme"]["tensors"] == 2 * 7 * 2
    rd = gguf.GGUFReader(out)
    assert _field(rd, "general.type") == "adapter" and _field(rd, "adapter.type") == "lora"
    assert {t.name for t in rd.tensors} >= {"blk.0.attn_q.weight.lora_a", "blk.1.ffn_down.weight.lora_b"}
    assert json.loads(open(str(out) + ".json").read())["scheme"]["rank"] == 8
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o666 & ~umask


def test_refusals_name_the_setting_and_write_nothing(models, tmp_path):
    import shutil

    from transformers import AutoConfig

    from conftest import run_cli

    def refused(src, match, **kw):
        out = tmp_path / "x.gguf"
        with pytest.raises(HfscaleError, match=match):
            FORMATS["gguf"].export(str(src), out, "Q8_0", False, verify=False, progress=False, **kw)
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(("x.gguf", "."))]

    def variant(family, name, edit_cfg=None, edit_tok=None):
        d = tmp_path / name
        shutil.copytree(models[family], d)
        if edit_cfg:
            cfg = AutoConfig.from_pretrained(d)
            edit_cfg(cfg)
            cfg.save_pretrained(d)
        if edit_tok:
            tj = json.loads((d / "tokenizer.json").read_text())
            edit_tok(tj)
            (d / "tokenizer.json").write_text(json.dumps(tj))
        return d

    def digits_in_twos(tj):
        tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = tj["pre_tokenizer"]["pretokenizers"][0][
            "pattern"]["Regex"].replace(r"\p{N}{1,3}", r"\p{N}{1,2}")

    refused(variant("llama", "rx", edit_tok=digits_in_twos), r"pre_tokenizer regex .* is not one llama.cpp implements")
    refused(variant("llama", "im", edit_tok=lambda tj: tj["model"].update(ignore_merges=False)),
            "ignore_merges=False with the llama-bpe pre-tokenizer")
    refused(variant("qwen3", "yarn", edit_cfg=lambda c: setattr(c, "rope_parameters", {
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 128})),
        "qwen3: rope_type 'yarn'")
    refused(variant("mistral", "swa", edit_cfg=lambda c: setattr(c, "sliding_window", 64)), "sliding_window=64")
    # (on the Llama dir: for model_type qwen2/qwen3, transformers 5 loads Qwen2Tokenizer, which rebuilds its
    # normalizer and pre-tokenizer itself, so an edited tokenizer.json is not what transformers runs there)
    refused(variant("llama", "nfkc", edit_tok=lambda tj: tj.update(normalizer={"type": "NFKC"})), "normalizer NFKC")
    # the CLI: one line, exit 2 (one subprocess; a model's refusals reach the CLI the same way, test_cli_refusals)
    dora = _lora(models["qwen2"], tmp_path / "dora", use_dora=True)
    r = run_cli("quantize", models["qwen2"], "--format", "gguf", "--adapter", dora, "--out", tmp_path / "x.gguf")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "DoRA" in r.stderr, r.stderr
    other = _lora(models["qwen3"], tmp_path / "other")  # trained on Qwen 3 (head_dim 32): q_proj is 128 wide there
    with pytest.raises(HfscaleError, match="do not fit the base weight"):
        export_gguf_adapter(str(models["qwen2"]), other, tmp_path / "x.gguf", verify=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(("x.gguf", "."))]
