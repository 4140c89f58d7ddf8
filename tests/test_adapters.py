"""hfscale.scale.adapters: the spec (validation, YAML section), targets (decoder linears only; Gemma 4's
per-layer projections never, its clippable linears through the inner linear), LoRA+ groups, tied embeddings
kept tied with trainable tokens, QLoRA's NF4 base (bitsandbytes on this CPU) and the merge into the
unquantized base. In process, the tiny Gemma 3 / a small Gemma 4; the engines are in tests/test_recipe.py."""

from __future__ import annotations

import pytest
import torch

from hfscale.scale.adapters import (DECODER_LINEARS, AdapterSpec, adapter_param_groups, apply_adapter, target_modules)
from hfscale.util.errors import ConfigError


def tiny(seed=0):
    from hfscale.models import build_model

    return build_model("tiny-gemma3", seed=seed, dtype=torch.float32)


def test_spec_defaults_and_yaml_section():
    s = AdapterSpec.from_mapping({"kind": "lora", "rank": 8})
    assert (s.alpha, s.dropout, s.targets, s.base_bits, s.dora) == (16.0, 0.0, DECODER_LINEARS, 16, False)
    assert AdapterSpec("qlora", rank=4).base_bits == 4 and AdapterSpec("dora").dora
    assert AdapterSpec("lora", targets="q_proj, v_proj").targets == ("q_proj", "v_proj")
    assert AdapterSpec.from_mapping("dora").kind == "dora" and not AdapterSpec.from_mapping(None).enabled
    assert AdapterSpec.from_mapping(s.to_dict()) == s  # round trip


@pytest.mark.parametrize("section,needle", [
    ({"kind": "lroa"}, "use one of none, lora, dora, qlora"),
    ({"kind": "lora", "rank": 0}, "--adapter none"),
    ({"kind": "lora", "alpha": -1}, "leave it unset"),
    ({"kind": "lora", "dropout": 1.5}, r"\[0, 1\)"),
    ({"kind": "lora", "lora_plus_ratio": 0.5}, "16 = the LoRA\\+ paper's"),
    ({"kind": "lora", "init": "svd"}, "default, gaussian, pissa, olora"),
    ({"kind": "qlora", "init": "pissa"}, "init default with qlora"),
    ({"kind": "lora", "rnak": 4}, "did you mean 'rank'"),
])
def test_spec_refuses_with_the_fix(section, needle):
    with pytest.raises(ConfigError, match=needle):
        AdapterSpec.from_mapping(section)


def test_targets_are_decoder_linears_only():
    from transformers import AutoModelForCausalLM

    from hfscale.models.builtin import tiny_gemma4_config

    names = target_modules(tiny(), AdapterSpec("lora"))
    assert len(names) == 4 * 7 and all(n.rsplit(".", 1)[-1] in DECODER_LINEARS for n in names)
    cfg = tiny_gemma4_config()
    cfg.hidden_size_per_layer_input = 16  # per-layer-embedding projections, as E2B / E4B have
    g4 = AutoModelForCausalLM.from_config(cfg)
    names = target_modules(g4, AdapterSpec("lora"))
    assert any("per_layer" in n for n, _ in g4.named_modules()) and not any("per_layer" in n for n in names)
    # 4 layers x 7, less v_proj on the 2 global layers (attention_k_eq_v: keys are the values)
    assert len(names) == 26
    with pytest.raises(ConfigError, match="some of .*down_proj"):
        target_modules(g4, AdapterSpec("lora", targets=("qkv",)))


def test_gemma4_clippable_linear_adapted_through_its_inner_linear():
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ClippableLinear

    class Tower(torch.nn.Module):  # the vision tower's attention shape, alone
        def __init__(self):
            super().__init__()
            cfg = type("C", (), {"use_clipped_linears": True})()
            self.vision_tower = torch.nn.ModuleDict({"q_proj": Gemma4ClippableLinear(cfg, 8, 8)})
            self.q_proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.q_proj(self.vision_tower["q_proj"](x))

    assert target_modules(Tower(), AdapterSpec("lora", rank=2)) == ["q_proj"]  # towers off by default
    spec = AdapterSpec("lora", rank=2, towers=True)
    assert target_modules(Tower(), spec) == ["vision_tower.q_proj.linear", "q_proj"]
    pm = apply_adapter(Tower(), spec)
    clip = pm.base_model.model.vision_tower["q_proj"]
    assert isinstance(clip, Gemma4ClippableLinear) and hasattr(clip.linear, "lora_A")  # clamps kept around it


def test_lora_plus_groups_and_only_adapters_train():
    spec = AdapterSpec("lora", rank=4, lora_plus_ratio=16)
    pm = apply_adapter(tiny(), spec)
    groups = adapter_param_groups(pm, spec, lr=1e-3)
    trainable = {id(p) for n, p in pm.named_parameters() if p.requires_grad}
    assert {id(p) for g in groups for p in g["params"]} == trainable and len(trainable) == 2 * 28
    a, b = groups
    assert (a["lr"], b["lr"], b["lr_scale"], len(b["params"])) == (1e-3, 16e-3, 16, 28)
    assert [g["lr_scale"] for g in adapter_param_groups(pm, AdapterSpec("lora", rank=4), 1e-3)] == [1.0]


def test_trainable_tokens_keep_tied_embeddings_tied():
    base = tiny()
    w0 = base.model.embed_tokens.weight.detach().clone()
    pm = apply_adapter(base, AdapterSpec("lora", rank=2, trainable_tokens=(5, 7)))
    delta = pm.base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta["default"]
    with torch.no_grad():
        delta.add_(1.0)
    merged = pm.merge_and_unload()
    assert merged.lm_head.weight is merged.model.embed_tokens.weight  # still one tensor (peft #1750 unties)
    changed = (merged.model.embed_tokens.weight - w0).abs().sum(1).nonzero().flatten().tolist()
    assert changed == [5, 7]


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_merge_equals_live_adapter(kind):
    """The merged model computes what base + adapter computed (fp32: merging adds B @ A x scale into W once;
    the live path computes x W^T + (x A^T) B^T x scale: the same sums in another order, |diff| ~ 1e-6 of logits ~ 1)."""
    from hfscale.scale.adapters import merge_live

    pm = apply_adapter(tiny(), AdapterSpec(kind, rank=4))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # B starts at zero: give the adapter something to say
    ids = torch.randint(3, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    pm.eval()
    with torch.no_grad():
        live = pm(input_ids=ids).logits
        plain = tiny()(input_ids=ids).logits
        merged = merge_live(pm)(input_ids=ids).logits
    assert (live - plain).abs().max() > 1e-2  # the adapter changes the output
    assert torch.allclose(merged, live, atol=1e-4, rtol=1e-4)


def test_recipe_adapter_settings(tmp_path):
    from hfscale.train.config import QATRecipeConfig, load_recipe

    y = tmp_path / "r.yaml"
    y.write_text("adapter: {kind: dora, rank: 4, alpha: 4, targets: [q_proj, v_proj], lora_plus_ratio: 16}\n")
    spec = load_recipe(str(y)).adapter_spec
    assert (spec.kind, spec.rank, spec.alpha, spec.targets, spec.lora_plus_ratio) == ("dora", 4, 4.0, ("q_proj", "v_proj"), 16)
    assert load_recipe(None, {"adapter": "qlora", "lora_rank": "8"}).adapter_spec.base_bits == 4
    assert not load_recipe(None, {}).adapter_spec.enabled
    for values, needle in [({"lora_rank": "8"}, "--lora-rank set without an adapter; add --adapter lora"),
                           ({"adapter": "qlora", "lora_init": "pissa"}, "init default with qlora")]:
        with pytest.raises(ConfigError, match=needle):
            load_recipe(None, values)
    y.write_text("adapter: {kind: lora, rnak: 4}\n")
    with pytest.raises(ConfigError, match="did you mean 'rank'"):
        load_recipe(str(y))
    with pytest.raises(ConfigError, match="qat_clm trains LoRA on the fake-quantized base with --lora-rank"):
        load_recipe(None, {"adapter": "lora"}, cls=QATRecipeConfig)


@pytest.mark.parametrize("zero,fsdp,needle", [(3, False, "zero2.yaml"), (None, True, "--adapter lora under FSDP2")])
def test_qlora_engines_that_cannot_hold_the_base_are_refused(zero, fsdp, needle):
    from hfscale.scale.adapters import qlora_dtypes

    with pytest.raises(ConfigError, match=needle):
        qlora_dtypes("bf16", zero, fsdp)
    assert qlora_dtypes("bf16", 2, False) == (torch.bfloat16, torch.uint8)  # DeepSpeed casts the module; packed bytes stay
    assert qlora_dtypes("bf16", None, False) == (torch.float32, torch.uint8)  # DDP: fp32 weights, autocast computes


def test_qlora_base_is_nf4_and_merges_into_the_unquantized_base(tmp_path):
    """bitsandbytes quantizes and runs forward and backward on this CPU; the adapter saved from the NF4 base merges
    into the fp32 base (merging into the 4-bit one is refused)."""
    from hfscale.scale.adapters import load_quantized_base, merge_into_base, nf4_bytes

    q = load_quantized_base("tiny-gemma3", torch.float32, torch.uint8, device_map="cpu")
    # NF4: 4 bits per weight of the 28 decoder linears (4 x 552,960 = 2,211,840 weights -> 1,105,920 bytes), one absmax
    # per 64 weights double-quantized to 8 bits (34,560 bytes) with an fp32 scale per 256 of those (~540 bytes):
    # 1,141,020 analytic; measured 1,141,184 (the per-module rounding of blocks and offsets: +0.014%)
    n = 4 * (2 * 192 * 192 + 2 * 96 * 192 + 3 * 768 * 192)
    analytic = n // 2 + n // 64 + n // 64 // 256 * 4
    assert abs(nf4_bytes(q) / analytic - 1) < 0.01
    pm = apply_adapter(q, AdapterSpec("qlora", rank=4))
    ids = torch.randint(3, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    pm(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in pm.named_parameters() if p.requires_grad)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    pm.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ConfigError, match="unquantized base"):
        merge_into_base(load_quantized_base("tiny-gemma3", torch.float32, torch.uint8, device_map="cpu"), tmp_path / "adapter")
    merged = merge_into_base(tiny(), tmp_path / "adapter")
    assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, tiny().model.layers[0].self_attn.q_proj.weight)
