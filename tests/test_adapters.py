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
    ({"kind": "dora", "experts": True}, "cannot run with DoRA here .*use kind lora"),  # peft's ParamWrapper refuses
    ({"kind": "lora", "dropout": 0.1, "experts": True}, "cannot run with lora_dropout 0.1"),
    ({"kind": "qlora", "experts": True}, "cannot run with a 4-bit"),
])
def test_spec_refuses_with_the_fix(section, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        AdapterSpec.from_mapping(section)
    assert "\n" not in str(e.value)


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


def test_template_tokens_resolve_from_the_chat_template():
    """`trainable_tokens: template` names the ids the chat template writes (hfscale.data.formats.template_token_ids):
    on the built-in tokenizer its <start_of_turn> / <end_of_turn> / role names are ordinary pieces, each found."""
    from hfscale.data.formats import data_tokenizer, template_mask, template_token_ids

    tok = data_tokenizer("tiny-gemma3")
    ids = template_token_ids(tok)
    pieces = set(tok.convert_ids_to_tokens(list(ids)))
    assert {"<bos>", "<", "start", "_", "of", "turn", ">", "end", "user", "mode", "l", "system"} <= pieces
    got, mask = template_mask(tok, [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}])
    assert [t for t, m in zip(tok.convert_ids_to_tokens(got), mask) if not m] == ["he", "ll", "o", "▁there", "h", "i"]
    spec = AdapterSpec.from_mapping({"kind": "lora", "trainable_tokens": "template, 7"})
    assert spec.names_template and spec.trainable_tokens == ("template", 7)
    assert spec.with_tokens(ids).trainable_tokens == tuple(sorted({7, *ids}))
    with pytest.raises(ConfigError, match="resolve it first"):
        apply_adapter(tiny(), spec)
    with pytest.raises(ConfigError, match="is not a token id; give ids"):
        AdapterSpec("lora", trainable_tokens="templates")


def test_template_tokens_of_a_template_that_refuses_a_system_turn():
    """A template that raises on a system turn (raise_exception, as Gemma 2's does) gives the ids of a user /
    assistant probe; one that refuses that too is one line naming the way out."""
    from hfscale.data.formats import data_tokenizer, template_token_ids
    from hfscale.util.errors import HfscaleError

    tok = data_tokenizer("tiny-gemma3")
    no_system = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
                 "[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    ids = template_token_ids(tok, no_system)
    assert set(tok.convert_ids_to_tokens(list(ids))) >= {"[", "user", "]"} and "system" not in tok.convert_ids_to_tokens(list(ids))
    with pytest.raises(HfscaleError, match="refused a user / assistant conversation"):
        template_token_ids(tok, "{{ raise_exception('never') }}")
    # a template whose own code fails (a TypeError, not a refusal) is not retried without the system turn: one line
    with pytest.raises(HfscaleError, match="the chat template failed on a probe conversation"):
        template_token_ids(tok, "{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}")


def test_template_tokens_train_only_their_rows_and_the_lora_tied_kept():
    """A few steps of LoRA + the template's rows: only those embedding rows (the tied lm_head with them) and the LoRA
    tensors move; merged, the lm_head is still the embedding tensor and every other base weight is bit-identical."""
    from hfscale.data.formats import data_tokenizer, template_token_ids
    from hfscale.models.loss import lm_loss
    from hfscale.scale.adapters import merge_live

    ids = template_token_ids(data_tokenizer("tiny-gemma3"))
    base = tiny()
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    spec = AdapterSpec("lora", rank=2, trainable_tokens="template").with_tokens(ids)
    pm = apply_adapter(base, spec)
    opt = torch.optim.AdamW(adapter_param_groups(pm, spec, lr=1e-2))
    batch = torch.tensor([list(ids) * 4])  # the template's own ids: their rows get gradients
    for _ in range(3):
        lm_loss(pm, batch).backward()
        opt.step()
        opt.zero_grad()
    trained = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n or "trainable_tokens_delta" in n for n in trained)
    merged = merge_live(pm)
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
    for n, p in merged.named_parameters():
        moved = (p.detach() != before[n]).reshape(p.shape[0], -1).any(1).nonzero().flatten().tolist() if p.dim() else []
        if n == "model.embed_tokens.weight":
            assert moved == list(ids)  # exactly the template's rows
        elif n.rsplit(".", 2)[-2] in DECODER_LINEARS:
            assert moved  # the LoRA, merged in
        else:
            assert not moved, n


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
    y.write_text("adapter: {kind: lora, experts: true}\n")  # MoE expert tensors: the recipe's `experts` reaches the spec
    assert load_recipe(str(y)).adapter_spec.experts and load_recipe(None, {"adapter": "lora", "lora_experts": "true"}).adapter_spec.experts
    with pytest.raises(ConfigError, match="adapter experts .* cannot run with DoRA"):
        load_recipe(None, {"adapter": "dora", "lora_experts": "true"})
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


def test_qlora_dtypes_per_engine_and_fsdp2_refused():
    from hfscale.scale.adapters import qlora_dtypes

    with pytest.raises(ConfigError, match="zero3.yaml, or use --adapter lora under FSDP2"):
        qlora_dtypes("bf16", None, True)
    # ZeRO-3 shards parameters of one dtype: the packed NF4 bytes are stored in the model's (tests/test_recipe.py runs it)
    assert qlora_dtypes("bf16", 3, False) == (torch.bfloat16, torch.bfloat16)
    assert qlora_dtypes("fp32", 3, False) == (torch.float32, torch.float32)  # precision auto without native bf16
    assert qlora_dtypes("bf16", 2, False) == (torch.bfloat16, torch.uint8)  # DeepSpeed casts the module; packed bytes stay
    assert qlora_dtypes("bf16", None, False) == (torch.float32, torch.uint8)  # DDP: fp32 weights, autocast computes


def test_an_evaluation_leaves_the_nf4_base_as_it_was():
    """bitsandbytes 0.50 on a CPU with AVX512-BF16 repacks a Linear4bit's weight in place at its first eval-mode
    no_grad forward (scales rounded to bf16); load_quantized_base keeps the portable layout (keep_bnb_layout_), so an
    evaluation in the middle of training changes neither the saved base nor the next training step. And NF4 bytes in
    a float storage dtype hold NaN bit patterns: compared by their bytes (same_bits), never by torch.equal."""
    from bitsandbytes.functional import has_avx512bf16
    from hfscale.scale.adapters import keep_bnb_layout_, load_quantized_base, same_bits

    ids = torch.randint(3, 4096, (2, 16), generator=torch.Generator().manual_seed(0))

    def eval_between(model):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        first = model.train()(input_ids=ids).logits.detach()
        with torch.no_grad():
            model.eval()(input_ids=ids)
        again = model.train()(input_ids=ids).logits.detach()
        after = model.state_dict()
        return [k for k in before if not same_bits(before[k], after[k])], (again - first).abs().max().item()

    q = load_quantized_base("tiny-gemma3", torch.bfloat16, torch.bfloat16, device_map="cpu")
    w = q.model.layers[0].self_attn.q_proj.weight
    assert w.isnan().any() and not torch.equal(w, w.clone()) and same_bits(w, w.clone())
    assert eval_between(q) == ([], 0.0)
    if has_avx512bf16():  # the trap itself, where this CPU has it (measured: absmax of all 28 linears, logits 0.014)
        for m in q.modules():
            if hasattr(m, "support_avx512bf16_for_cpu"):
                m.support_avx512bf16_for_cpu = True
        moved, logits = eval_between(q)
        assert len([k for k in moved if k.endswith(".absmax")]) == 28 and logits > 1e-3
    assert keep_bnb_layout_(q) == 28


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


# --- MoE experts: LoRA on the fused 3-D expert tensors (peft's target_parameters) ----------------------------------

def _qwen3_moe(**kw):
    """A tiny Qwen3-MoE: 2 layers of 4 experts (top 2), experts fused as transformers 5 stores them
    (experts.gate_up_proj [4, 32, 32], experts.down_proj [4, 32, 16]), the router `mlp.gate` a bare weight."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                          num_experts_per_tok=2, **kw)


def _gemma4_moe():
    """The small Gemma 4 (tiny_gemma4_config: a sliding and a k_eq_v global layer) with the 26B-A4B block: a router
    (router.proj, an nn.Linear), 4 experts (top 2) beside the dense MLP in every layer."""
    from hfscale.models.builtin import tiny_gemma4_config

    cfg = tiny_gemma4_config()
    cfg.vocab_size = cfg.vocab_size_per_layer_input = 256
    cfg.num_hidden_layers, cfg.layer_types = 2, cfg.layer_types[:2]
    cfg.hidden_size, cfg.intermediate_size = 64, 128
    cfg.enable_moe_block, cfg.num_experts, cfg.top_k_experts, cfg.moe_intermediate_size = True, 4, 2, 32
    return cfg


def _build(cfg):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma4"])
def test_expert_lora_trains_the_experts_and_chosen_linears_alone_and_merges(family, tmp_path):
    """Expert LoRA + q/v: exactly those tensors get an adapter (by their real names; the router none), a
    forward/backward + AdamW step moves adapter parameters only (the rest bit for bit), and the saved adapter merged
    into a fresh base computes what base + adapter computed."""
    from safetensors import safe_open

    from hfscale.scale.adapters import adapted, expert_parameters, merge_into_base

    cfg = _qwen3_moe() if family == "qwen3_moe" else _gemma4_moe()
    spec = AdapterSpec("lora", rank=4, targets=("q_proj", "v_proj"), experts=True)
    base = _build(cfg)
    experts = expert_parameters(base, spec)
    prefix = "model.layers.{}.mlp.experts" if family == "qwen3_moe" else "model.layers.{}.experts"
    layers = cfg.num_hidden_layers
    assert experts == [f"{prefix.format(i)}.{p}" for i in range(layers) for p in ("gate_up_proj", "down_proj")]
    linears = target_modules(base, spec)
    stacks = [tuple(base.get_parameter(n).shape) for n in experts]  # [E, out, in]
    pm = apply_adapter(base, spec)
    assert adapted(pm) == (set(linears), set(experts))
    router = ".mlp.gate." if family == "qwen3_moe" else ".router."
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert all("lora_" in n for n in trainable) and not any(router in n for n in trainable)
    # peft's ParamWrapper: A [r x E, in], B [out, r x E] per expert tensor; one A and one B per linear
    assert len(trainable) == 2 * (len(linears) + len(experts))

    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    pm(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    moved = {n for n, p in pm.named_parameters() if not torch.equal(p, before[n])}
    assert moved == set(trainable)  # every adapter tensor moved, nothing else (expert stacks and router included)
    assert all(p.grad is None for n, p in pm.named_parameters() if not p.requires_grad)

    pm.save_pretrained(tmp_path / "adapter")
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    # the file holds every adapter tensor whole: per expert stack [E, out, in] an A [r x E, in] and a B [out, r x E]
    rE = 4 * cfg.num_experts
    assert len(shapes) == len(trainable)
    assert sorted(v for k, v in shapes.items() if ".experts." in k) == sorted(
        x for _, o, i in stacks for x in ((rE, i), (o, rE)))
    # fp32 throughout: merging adds scale x B A into W once; the live path adds it per forward (baddbmm for the expert
    # stacks, x A^T B^T for the linears): the same sums in another order. Measured |diff| 1e-7 (Qwen3-MoE) and 3.6e-6
    # (Gemma 4, soft-capped) on logits ~ 0.5; 1e-4 leaves rounding room on other kernels (AVX2), while the adapter
    # moved the logits by 0.1 / 0.67, and a routing change (an expert picked differently) moves them far more
    with torch.no_grad():
        live = pm(input_ids=ids).logits
        with pm.disable_adapter():
            plain = pm(input_ids=ids).logits
        merged = merge_into_base(_build(cfg), tmp_path / "adapter")  # peft's from_pretrained + merge_and_unload
        saved = merged(input_ids=ids).logits
    assert (live - plain).abs().max() > 1e-2
    assert torch.allclose(saved, live, atol=1e-4, rtol=1e-4)
    assert not any("lora" in n for n, _ in merged.named_parameters())


def test_expert_lora_refusals_are_one_line():
    from hfscale.scale.adapters import check_engine

    with pytest.raises(ConfigError, match="no MoE expert tensors.*drop experts") as e:
        apply_adapter(tiny(), AdapterSpec("lora", rank=2, experts=True))
    assert "\n" not in str(e.value)
    # peft's target_parameters ran under DDP, ZeRO-2, ZeRO-3 (zero.Init) and FSDP2 (tests/scripts/expert_lora_engines.py,
    # by hand): no engine refuses expert LoRA; QLoRA stays refused under FSDP2 alone
    for zero, fsdp in [(3, False), (None, True), (2, False), (None, False)]:
        check_engine(AdapterSpec("lora", rank=2, experts=True), zero, fsdp)
        if fsdp:
            with pytest.raises(ConfigError, match="ddp.yaml, zero2.yaml or zero3.yaml"):
                check_engine(AdapterSpec("qlora", rank=2), zero, fsdp)
        else:
            check_engine(AdapterSpec("qlora", rank=2), zero, fsdp)


def test_trainable_tokens_refused_where_they_failed():
    """peft's trainable_token_indices failed under ZeRO-3 (gathers onto CUDA only) and FSDP2 (accelerate re-ties the
    embedding by a name peft moved) on 2 CPU ranks, and ran under DDP (by hand): refused in one line there, before any
    process group, by the recipe and by doctor from the files alike."""
    from hfscale.doctor.adapters import adapter_engine_refused
    from hfscale.doctor.inputs import Setup
    from hfscale.scale.adapters import check_engine

    spec = AdapterSpec("lora", rank=2, trainable_tokens="template")
    for zero, fsdp, needle in [(3, False, "ZeRO-3 failed here: .*CUDA only"), (None, True, "FSDP2 failed here")]:
        with pytest.raises(ConfigError, match=needle + ".*ddp.yaml or zero2.yaml, or drop trainable_tokens") as e:
            check_engine(spec, zero, fsdp)
        assert "\n" not in str(e.value)
        check_engine(AdapterSpec("lora", rank=2), zero, fsdp)  # plain LoRA runs there
    for zero in (None, 2):
        check_engine(spec, zero, False)
    fsdp2 = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}
    found = list(adapter_engine_refused(Setup(accelerate=fsdp2, args={"adapter": {"kind": "lora",
                                                                                  "trainable_tokens": "template"}})))
    assert len(found) == 1 and "FSDP2 failed here" in found[0].what
    assert not list(adapter_engine_refused(Setup(accelerate=fsdp2, args={"adapter": {"kind": "lora"}})))


def test_peft_moving_the_targets_on_a_moe_model_is_refused():
    """peft 0.21 rewrites the targets of Qwen3-MoE models (its transformers-v5 conversion maps gate_proj / up_proj /
    down_proj onto the fused expert tensors): a dense MLP layer's linears would silently become expert LoRA."""
    cfg = _qwen3_moe(mlp_only_layers=[1])  # layer 1: a dense MLP with gate_proj / up_proj / down_proj
    with pytest.raises(ConfigError, match="peft adapted other tensors than asked on this qwen3_moe .*set adapter "
                                          "targets to the attention linears"):
        apply_adapter(_build(cfg), AdapterSpec("lora", rank=2))
    pm = apply_adapter(_build(cfg), AdapterSpec("lora", rank=2, targets=("q_proj", "k_proj", "v_proj", "o_proj")))
    assert len([n for n, p in pm.named_parameters() if p.requires_grad]) == 2 * 4 * 2


def test_chat_data_without_template_rows_gets_the_note_where_the_engine_allows_them():
    """An adapter run on chat data that adapts no embedding row is told where most of full fine-tuning's lead lies
    (the template's rows, benchmarks/results/adapters.md); not on text data, not when rows train or the embedding is
    adapted, not without an adapter, not where the engine refuses both (ZeRO-3, FSDP2)."""
    from hfscale.scale.adapters import template_tokens_note

    lora = AdapterSpec("lora", rank=2)
    note = template_tokens_note(lora, "messages", None, False)
    assert note and "--lora-trainable-tokens template" in note and "--lora-embedding true" in note and "\n" not in note
    assert template_tokens_note(AdapterSpec("qlora", rank=2), "messages", 2, False)  # DDP / ZeRO-1/2 alike
    for spec, fmt, zero, fsdp in [(lora, "text", None, False), (AdapterSpec("lora", rank=2, trainable_tokens="template"),
                                  "messages", None, False), (AdapterSpec("lora", rank=2, embedding=True), "messages",
                                                             None, False), (AdapterSpec(), "messages", None, False),
                                  (lora, "messages", 3, False), (lora, "messages", None, True)]:
        assert template_tokens_note(spec, fmt, zero, fsdp) is None, (spec, fmt, zero, fsdp)


def test_embedding_adapter_is_one_tied_pair_that_trains_saves_reloads_and_merges_tied(tmp_path):
    """AdapterSpec(embedding=True) on a tied model: LoRA on the input embedding and on the lm_head, whose factors are
    the embedding's own Parameters transposed (hfscale.scale.adapters.tie_head_adapter_; peft's ensure_weight_tying
    alone makes them new Parameters over the same storage, two Adam states stepping it twice). The output side's
    gradient reaches the pair (rows of tokens the input never held), the base stays bit for bit, the adapter file holds
    the pair (and peft's names for the lm_head's: the same, transposed) and no embedding matrix, it reloads with peft
    (no missing key) to the live logits and merges into one matrix, still tied."""
    from peft import PeftModel
    from safetensors import safe_open

    from hfscale.models.loss import lm_loss
    from hfscale.scale.adapters import merge_into_base, merge_live

    base = tiny()
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    spec = AdapterSpec("lora", rank=4, embedding=True)
    pm = apply_adapter(base, spec)
    emb, head = pm.get_input_embeddings(), pm.get_output_embeddings()
    trained = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    assert len(trained) == 2 * 4 * 7 + 2 and not [n for n in trained if "lm_head" in n]
    assert head.lora_A["default"].source is emb.lora_embedding_B["default"]  # the same tensors, not copies
    assert head.lora_B["default"].source is emb.lora_embedding_A["default"]
    batch = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))  # ids < 100 only
    opt = torch.optim.AdamW(adapter_param_groups(pm, spec, lr=1e-2))
    for step in range(3):
        lm_loss(pm, batch).backward()
        if step == 0:  # lora_embedding_A [r, vocab]: its columns of ids the input never held move through the lm_head
            assert emb.lora_embedding_A["default"].grad[:, 100:].abs().sum(0).gt(0).all()
        opt.step()
        opt.zero_grad()
    frozen = {n.replace(".base_layer", ""): p for n, p in base.named_parameters() if not p.requires_grad}
    assert set(frozen) == set(before) and all(torch.equal(p, before[n]) for n, p in frozen.items())  # the base, whole
    ids = torch.randint(3, 4096, (2, 16), generator=torch.Generator().manual_seed(1))
    pm.eval()
    with torch.no_grad():
        live, plain = pm(input_ids=ids).logits, tiny()(input_ids=ids).logits
    assert (live - plain).abs().max() > 1e-1
    # saved as the recipe saves (hfscale.train.state.save_final_adapter): the trained tensors, no embedding matrix
    from hfscale.scale.adapters import tied_head_factors

    state = {n: p.detach().clone() for n, p in trained.items()}
    state.update(tied_head_factors(pm, state))  # peft's names for the lm_head's (the embedding's factors, transposed)
    pm.save_pretrained(tmp_path, state_dict=state, safe_serialization=True, save_embedding_layers=False)
    with safe_open(str(tmp_path / "adapter_model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    emb_keys = {k: v for k, v in shapes.items() if "embed" in k or "lm_head" in k}
    assert len(shapes) == 60 and sorted(emb_keys.values()) == [(4, 192), (4, 4096), (192, 4), (4096, 4)], emb_keys
    import warnings

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # peft's "Found missing adapter keys" would be one: none missing
        warnings.filterwarnings("ignore", message=".*tied_target_modules.*")
        reloaded = PeftModel.from_pretrained(tiny(), tmp_path).eval()(input_ids=ids).logits
        merged_model = merge_into_base(tiny(), tmp_path).eval()
        merged = merged_model(input_ids=ids).logits
    assert torch.allclose(reloaded, live, atol=1e-5, rtol=0)
    # merged once into the one matrix (merging the lm_head's delta too would add it twice: measured 1.36 off)
    assert torch.allclose(merged, live, atol=1e-4, rtol=1e-4)
    assert merged_model.lm_head.weight is merged_model.model.embed_tokens.weight
    with torch.no_grad():  # the live model merged in place: the same one matrix, once
        merged_live = merge_live(pm).eval()
        assert torch.allclose(merged_live(input_ids=ids).logits, live, atol=1e-4, rtol=1e-4)
    assert merged_live.lm_head.weight is merged_live.model.embed_tokens.weight
    # an adapter whose lm_head LoRA was trained apart from the embedding's (peft without ensure_weight_tying) cannot
    # merge as tied: one line, never silently dropped
    import json

    from safetensors.torch import save_file

    with safe_open(str(tmp_path / "adapter_model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["base_model.model.lm_head.lora_B.weight"] += 0.01
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "ensure_weight_tying": False}))
    with pytest.raises(ConfigError, match="lm_head LoRA is not the embedding's"):
        merge_into_base(tiny(), tmp_path)
    src = tiny().state_dict()
    moved = {k for k, v in merged_model.state_dict().items() if not torch.equal(v, src[k])}
    assert moved == {f"model.layers.{i}.{g}.{n}.weight" for i in range(4) for g, ns in
                     (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
                     for n in ns} | {"model.embed_tokens.weight", "lm_head.weight"}


def test_embedding_adapter_refusals():
    """What the embedding adapter cannot run with is one line: trainable_tokens (both adapt the embedding), DoRA, an
    SVD / QR init, ZeRO-3 (by hand: a 1-rank resume failed in backward) and FSDP2 (fully_shard re-registers the shared
    factor), in the recipe and in doctor alike; DDP and ZeRO-2 ran and resumed by hand (docs/adapters.md)."""
    from hfscale.doctor.adapters import adapter_engine_refused
    from hfscale.doctor.inputs import Setup
    from hfscale.scale.adapters import check_engine

    for kind, extra, needle in [("lora", {"trainable_tokens": "template"}, "trainable_tokens"),
                                ("lora", {"init": "pissa"}, "init pissa"), ("dora", {}, "DoRA")]:
        with pytest.raises(ConfigError, match=f"adapter embedding cannot run with {needle}"):
            AdapterSpec(kind, rank=2, embedding=True, **extra)
    AdapterSpec("qlora", rank=2, embedding=True)  # the embedding and lm_head stay unquantized: allowed
    with pytest.raises(ConfigError, match="embedding must be true or false"):
        AdapterSpec.from_mapping({"kind": "lora", "embedding": "false"})
    spec = AdapterSpec("lora", rank=2, embedding=True)
    assert "embedding" in spec.describe()
    for zero, fsdp, needle in [(3, False, "ZeRO-3 failed here: .*resumed on 1 rank"), (None, True, "FSDP2 failed here")]:
        with pytest.raises(ConfigError, match=needle + ".*ddp.yaml or zero2.yaml, or drop embedding") as e:
            check_engine(spec, zero, fsdp)
        assert "\n" not in str(e.value)
    for zero in (None, 1, 2):
        check_engine(spec, zero, False)
    fsdp2 = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}
    found = list(adapter_engine_refused(Setup(accelerate=fsdp2, args={"adapter": {"kind": "lora", "embedding": True}})))
    assert len(found) == 1 and "FSDP2 failed here" in found[0].what
