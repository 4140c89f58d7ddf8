"""The default plan (a traced step) against the analytic fast path (`--fast`), for every family that has formulas.

No family answers analytically by default: the analytic terms are model states + saved activations, without the
temporaries and phases of a real step (it adds all gradients to all activations, which never coexist in full, and
misses the loss's temporaries), so they are a fast path and a fallback, not the truth. What they must agree on
with the trace is exact: the model states (weights and AdamW's moments; the trace also counts AdamW's 4-byte
`step` counter per parameter tensor)."""

import json

import pytest

from hfscale.plan import plan

SHAPES = [dict(micro_batch=1, seq_len=64), dict(micro_batch=2, seq_len=128, checkpointing="full"),
          dict(micro_batch=2, seq_len=64, checkpointing="every:2"), dict(micro_batch=1, seq_len=64, lora_rank=4)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from hfscale.testing.zoo import ARCHITECTURES

    out = {"gemma3": "tiny-gemma3"}
    for arch in ("gemma4", "llama"):  # llama's formulas also cover mistral and qwen2
        d = tmp_path_factory.mktemp(arch)
        ARCHITECTURES[arch]().save_pretrained(d)
        out[arch] = str(d)
    return out


@pytest.mark.parametrize("family", ["gemma3", "gemma4", "llama"])
def test_fast_path_states_equal_the_trace(models, family):
    import torch
    from transformers import AutoModelForCausalLM

    from hfscale.models import load_config

    with torch.device("meta"):
        tensors = sum(1 for _ in AutoModelForCausalLM.from_config(load_config(models[family])).parameters())
    for shape in SHAPES:
        kw = dict(shape, precision="fp32")
        traced, fast = plan(models[family], **kw).prediction, plan(models[family], **kw, method="fast").prediction
        assert traced.source == "trace" and fast.source == "analytic" and "--fast" in fast.not_traced
        at = traced.breakdown  # by kind at the traced peak
        assert fast.terms["weights"] == at["parameters"], (family, shape)
        step_counters = at["optimizer"] - fast.terms["optimizer"]  # AdamW's 4-byte step, one per trained tensor
        if kw.get("lora_rank"):
            assert step_counters > 0 and step_counters % 4 == 0, (family, shape, step_counters)
        else:
            assert step_counters == 4 * tensors, (family, shape, step_counters)


def test_cli_default_says_what_answered(cli, models):
    r = cli("plan", "--model", models["llama"], "--seq-len", "64", "--micro-batch", "1", "--optimizer", "sgd", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["prediction"]
    assert p["source"] == "analytic" and "AdamW" in p["peak_not_traced"]  # the trace runs AdamW only
    r = cli("plan", "--model", models["llama"], "--seq-len", "64", "--micro-batch", "1", "--optimizer", "sgd", "--trace")
    assert r.returncode == 2 and "--trace" in r.stderr and len(r.stderr.strip().splitlines()) == 1
