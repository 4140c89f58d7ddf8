"""hfscale.train.adapter_ckpt in one process (accelerate on CPU, no engine launch): an adapter's checkpoint state holds
the trained tensors alone and loads over a base it does not hold; an empty adapter, another base source and a base
with other bytes are refused in one line. The engines (DDP, ZeRO-3, FSDP2, and their rank-count changes) are in
tests/test_recipe.py's adapter launches."""

from __future__ import annotations

import pytest
import torch

from hfscale.scale.adapters import AdapterSpec, apply_adapter
from hfscale.train.adapter_ckpt import adapter_only, base_digest, check_digest, check_source, source_key
from hfscale.util.errors import HfscaleError


def adapted(seed=0):
    from hfscale.models import build_model

    return apply_adapter(build_model("tiny-gemma3", seed=seed, dtype=torch.float32), AdapterSpec("lora", rank=4))


def test_state_holds_the_adapter_alone_and_loads_over_a_base_it_does_not_hold(tmp_path):
    from accelerate import Accelerator
    from safetensors import safe_open

    acc = Accelerator(cpu=True)
    model = adapted()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = acc.prepare(model, opt)
    ids = torch.randint(3, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert len(trained) == 4 * 7 * 2 and any(n.endswith("lora_B.default.weight") and p.abs().sum() > 0
                                             for n, p in trained.items())
    with adapter_only(acc, model) as kw:
        assert kw == {}  # DeepSpeed alone takes keyword arguments (exclude_frozen_parameters)
        acc.save_state(str(tmp_path / "ckpt"))
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), framework="pt") as f:
        held = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert held == {n: tuple(p.shape) for n, p in trained.items()}  # 2 x 28 tensors, nothing of the base
    assert set(model.state_dict()) > set(held)  # outside the scope the state_dict is whole again

    base_key = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    marked = model.get_parameter(base_key).detach().clone().add_(1.0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.zero_()
        model.get_parameter(base_key).copy_(marked)  # the base as this run built it: the checkpoint must not touch it
    with adapter_only(acc, model):
        acc.load_state(str(tmp_path / "ckpt"))
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters() if p.requires_grad)
    assert torch.equal(model.get_parameter(base_key), marked)
    assert len(opt.state_dict()["state"]) == len(trained)  # Adam's moments came back for the adapter alone

    frozen = adapted()
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(HfscaleError, match=r"^the adapter run has no trained parameter to checkpoint \(an empty adapter\)"):
        with adapter_only(acc, frozen):
            pass


def test_the_base_digest_reads_the_frozen_bytes_alone():
    a, b = adapted(), adapted()
    d = base_digest(a)
    assert base_digest(b) == d  # the same source and seed: the same base
    with torch.no_grad():
        b.get_parameter("base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight").add_(1.0)
    assert base_digest(b) == d  # the adapter is not the base
    with torch.no_grad():
        b.get_parameter("base_model.model.model.norm.weight").view(-1)[0] += 1e-3
    assert base_digest(b) != d
    check_digest("ckpt", {"source": "tiny-gemma3", "digest": d}, d)
    with pytest.raises(HfscaleError, match=r"^the base built from tiny-gemma3 differs from the one checkpoint ckpt was "
                                           r"trained on \(its bytes hash [0-9a-f]+, the checkpoint's base [0-9a-f]+\)"):
        check_digest("ckpt", {"source": "tiny-gemma3", "digest": d}, base_digest(b))


def test_another_base_source_is_refused_before_a_launch(tmp_path):
    from hfscale.scale.adapters import write_weights

    saved = source_key("tiny-gemma3", 0)
    assert saved == {"source": "tiny-gemma3", "seed": 0}
    check_source(tmp_path, saved, source_key("tiny-gemma3", 0))
    check_source(tmp_path, None, saved)  # a checkpoint that holds its base (before adapter-only, or full fine-tuning)
    with pytest.raises(HfscaleError, match=r"trained on another base \(seed 0 \(now 1\)\); resume with --model "
                                           r"tiny-gemma3 --seed 0, or start a new --output-dir$"):
        check_source(tmp_path, saved, source_key("tiny-gemma3", 1))
    # a directory: its weight files' names, sizes and safetensors headers, no tensor read; its path is shown only
    import shutil

    from hfscale.models import build_model

    model = build_model("tiny-gemma3", seed=0, dtype=torch.float32)
    one = source_key(str(write_weights(model, tmp_path / "one")), 0)
    assert one["files"] and source_key(str(tmp_path / "one"), 7) == one  # the seed builds nothing there
    shutil.copytree(tmp_path / "one", tmp_path / "moved")
    (tmp_path / "moved" / "config.json").write_text((tmp_path / "one" / "config.json").read_text() + "\n")  # re-saved
    (tmp_path / "moved" / "training_args.bin").write_bytes(b"x")  # not a weight file
    check_source(tmp_path, one, source_key(str(tmp_path / "moved"), 0))  # the same weights elsewhere: the same base
    write_weights(model.to(torch.bfloat16), tmp_path / "one")  # other dtypes in the header: another base
    with pytest.raises(HfscaleError, match="trained on another base"):
        check_source(tmp_path, one, source_key(str(tmp_path / "one"), 0))
