"""llama.cpp's Q4_0 grid in torch: bytes identical to the gguf package's (ggml's reference rule),
and a QAT model's converted weights survive a Q4_0 GGUF export bit for bit."""

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from torch import nn

from hfscale.compress.ggml_grid import (convert_q4_0_, fake_q4_0, prepare_q4_0_qat_, q4_0_pack, q4_0_quantize,
                                        q4_0_round_trip)

Q4_0 = gguf.GGMLQuantizationType.Q4_0


def _cases():
    g = torch.Generator().manual_seed(0)
    yield torch.randn(64, 192, generator=g) * 0.02
    yield torch.randn(16, 64, generator=g) * torch.logspace(-9, 3, 16).unsqueeze(1)  # fp16-subnormal to large d
    yield torch.zeros(2, 32)
    yield torch.tensor([[0.5] * 16 + [-0.5] * 16, [-0.5] * 16 + [0.5] * 16])  # |max| ties: the first wins
    yield torch.randint(-8, 8, (4, 96), generator=g).float() * 0.25  # values exactly on a grid: .5 ties


@pytest.mark.parametrize("w", list(_cases()))
def test_bytes_and_values_match_gguf_reference(w):
    assert q4_0_pack(w) == quantize(w.numpy(), Q4_0).tobytes()
    ref = torch.from_numpy(dequantize(quantize(w.numpy(), Q4_0), Q4_0))
    assert torch.equal(q4_0_round_trip(w), ref)


def test_rule_by_hand():
    # max-abs element is -4 (signed) -> d = -4 / -8 = 0.5; q = trunc(x / 0.5 + 8.5) clamped to 15
    x = torch.tensor([-4.0, 3.9, 1.25, -1.25, 0.0] + [0.1] * 27)
    d, q = q4_0_quantize(x)
    assert d.item() == 0.5
    assert q[0, :5].tolist() == [0, 15, 11, 6, 8]  # 3.9/0.5+8.5=16.3 -> 15; 1.25/0.5+8.5=11; -2.5+8.5=6
    # a positive extreme gets a negative d and still lands on q=0 (value -8*d = +max)
    d2, q2 = q4_0_quantize(-x)
    assert d2.item() == -0.5 and q2[0, 0].item() == 0


def test_round_trip_is_idempotent_on_trained_like_weights():
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    once = q4_0_round_trip(w)
    assert torch.equal(q4_0_round_trip(once), once)
    assert not torch.equal(once, w)


def test_straight_through_gradient():
    w = torch.randn(4, 64, requires_grad=True)
    y = fake_q4_0(w)
    assert torch.equal(y.detach(), q4_0_round_trip(w))
    (y * torch.arange(64.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(64.0).expand(4, 64))


def test_rows_not_multiple_of_32_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        q4_0_quantize(torch.zeros(3, 48))


@pytest.fixture(scope="module")
def qat_model():
    from hfscale.models import TINY, build_model

    m = build_model(TINY, seed=0)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    prepare_q4_0_qat_(m)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    ids = torch.randint(4, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # gradients reach the latent fp32 weights through the fake-quantizer
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    trained = {k: v.clone() for k, v in m.state_dict().items()}
    convert_q4_0_(m)
    return m, before, trained


def test_prepare_keeps_tied_embedding_and_convert_restores_plain_linear(qat_model):
    m, before, trained = qat_model
    assert m.lm_head.weight is m.model.embed_tokens.weight  # still tied
    assert type(m.lm_head) is nn.Linear and type(m.model.layers[0].mlp.up_proj) is nn.Linear
    # the embedding was trained but not snapped (include_embeddings=False)
    emb = m.model.embed_tokens.weight
    assert torch.equal(emb, trained["model.embed_tokens.weight"])
    q = m.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(trained["model.layers.0.self_attn.q_proj.weight"], before["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(q, q4_0_round_trip(trained["model.layers.0.self_attn.q_proj.weight"]))
    with pytest.raises(ValueError, match="not prepared"):
        convert_q4_0_(m)


def test_converted_weights_survive_q4_0_gguf_bit_exactly(qat_model, tmp_path):
    from hfscale.export.gguf import GGUFOptions, write_gguf
    from hfscale.models import TINY, load_tokenizer

    m, _, _ = qat_model
    out = tmp_path / "qat.gguf"
    counts = write_gguf(m, load_tokenizer(TINY), out, GGUFOptions("Q4_0"), progress=False)
    assert counts == {"Q8_0": 1, "Q4_0": 28, "F32": 25}  # 4 layers x 7 linears; embedding Q8_0
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.GEMMA3, 4)
    sd = m.state_dict()
    by_gguf = {names.get_name(k, try_suffixes=(".weight",)): k for k in sd if k != "lm_head.weight"}
    checked = 0
    for t in gguf.GGUFReader(out).tensors:
        if t.tensor_type != Q4_0:
            continue
        got = torch.from_numpy(np.ascontiguousarray(dequantize(t.data, Q4_0)))
        want = sd[by_gguf[t.name]]
        assert got.shape == want.shape and torch.equal(got, want), t.name
        checked += 1
    assert checked == 28
