"""hfscale.models.varlen: packed documents attend within themselves through transformers' AttentionInterface,
without an L x L mask. Checked against the same documents run one by one and against sdpa's block-diagonal mask,
on the tiny Gemma 3 (4 heads over 2 K/V heads, 3 of 4 layers sliding a 64-token window), fp32, CPU; and the
kernel alone against masked attention written out. No timing here (benchmarks/data_pipeline.py (d))."""

from __future__ import annotations

import pytest
import torch

from hfscale.models.documents import block_causal_mask, flash_varlen_kwargs, forward_kwargs
from hfscale.models.varlen import NAME, documents, register, set_attention_, use_varlen_, varlen_attention

# fp32 throughout. The paths differ only in the order of float sums (a document's softmax over its own keys vs the
# same keys inside a masked row, where masked entries add exact zeros; GEMMs over other shapes pick other blockings),
# so they agree to a few fp32 ulps per operation: measured here max |diff| 1.1e-6 on logits (|logits| <= 1.4), 8.9e-7
# of the largest gradient entry, the summed loss within 6.3e-8. The tolerances leave ~100x margin for other hosts'
# kernels (AVX2 vs AVX512 GEMM blockings) and stay >= 10,000x below what attending across a boundary moves a later
# document's logits (measured 1.6-1.8; `test_cross_boundary_attention_is_caught` requires > 100 x LOGIT_TOL).
LOGIT_TOL = 1e-4  # absolute
GRAD_TOL = 1e-4  # relative to the largest gradient entry
ROWS = [[200, 40], [40, 100, 90]]  # documents per row: 200 (>= 3 windows: the blocked path), 100 and 90 (masked band)
L = 256


@pytest.fixture(scope="module")
def model():
    from hfscale.models import build_model

    m = build_model("tiny-gemma3", seed=0).float()
    m.train()  # dropout is 0 in the tiny config; train mode is where the use_cache trap lives
    return m


def packed_batch(rows=ROWS, length=L, seed=0):
    """hfscale.models.documents' contract: positions restart per document, padding a dummy document of its own."""
    g = torch.Generator().manual_seed(seed)
    ids, pos = [], []
    for docs in rows:
        row_ids = torch.cat([torch.randint(3, 4000, (n,), generator=g) for n in docs])
        row_pos = torch.cat([torch.arange(n) for n in docs])
        pad = length - len(row_ids)
        ids.append(torch.cat([row_ids, torch.zeros(pad, dtype=torch.long)]))
        pos.append(torch.cat([row_pos, torch.arange(pad)]))
    ids, pos = torch.stack(ids), torch.stack(pos)
    labels = ids.clone()
    labels[pos == 0] = -100
    for b, docs in enumerate(rows):
        labels[b, sum(docs):] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def spans(rows=ROWS):
    for b, docs in enumerate(rows):
        start = 0
        for n in docs:
            yield b, start, n
            start += n


def summed_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                             ignore_index=-100, reduction="sum")


def run_packed(model, batch, kernel):
    set_attention_(model, kernel)
    model.zero_grad(set_to_none=True)
    out = model(**forward_kwargs({k: v for k, v in batch.items() if k != "labels"}, kernel))
    loss = summed_loss(out.logits, batch["labels"])
    loss.backward()
    return out.logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def run_one_by_one(model, batch):
    """Each document alone (a batch of one, positions 0..n-1, no packing): sdpa, the window from transformers."""
    set_attention_(model, "sdpa")
    model.zero_grad(set_to_none=True)
    logits, total = {}, 0.0
    for b, s, n in spans():
        out = model(input_ids=batch["input_ids"][b:b + 1, s:s + n], use_cache=False)
        loss = summed_loss(out.logits, batch["labels"][b:b + 1, s:s + n])
        loss.backward()
        logits[(b, s)] = out.logits.detach()[0]
        total = total + loss.detach()
    return logits, total, {n: p.grad.clone() for n, p in model.named_parameters()}


def grad_diff(a, b):
    scale = max(v.abs().max() for v in b.values())
    return max((a[k] - b[k]).abs().max() for k in b) / scale


@pytest.fixture(scope="module")
def runs(model):
    """One forward + backward each, shared by the tests below: varlen and sdpa on the packed batch, the documents
    one by one."""
    batch = packed_batch()
    return {"batch": batch, "varlen": run_packed(model, batch, "varlen"), "sdpa": run_packed(model, batch, "sdpa"),
            "one_by_one": run_one_by_one(model, batch)}


def test_packed_rows_equal_documents_one_by_one(runs):
    logits, loss, grads = runs["varlen"]
    ref_logits, ref_loss, ref_grads = runs["one_by_one"]
    for (b, s), ref in ref_logits.items():
        assert (logits[b, s:s + len(ref)] - ref).abs().max() < LOGIT_TOL, (b, s)
    assert abs(loss - ref_loss) / ref_loss < 1e-6  # a sum of ~450 CE terms of ~8.4 each
    assert grad_diff(grads, ref_grads) < GRAD_TOL


def test_varlen_equals_block_diagonal_sdpa(runs):
    (logits, loss, grads), (s_logits, s_loss, s_grads) = runs["varlen"], runs["sdpa"]
    assert (logits - s_logits).abs().max() < LOGIT_TOL  # every position, the padding's dummy document included
    assert (runs["batch"]["labels"] != -100).sum() > 400 and abs(loss - s_loss) / s_loss < 1e-6
    assert grad_diff(grads, s_grads) < GRAD_TOL


def test_cross_boundary_attention_is_caught(model, runs):
    """The comparisons above can fail: the same row with attention allowed across its boundaries (sdpa's default
    train-mode forward, which makes a cache and then skips transformers' packed-sequence mask) moves the later
    documents' logits far past LOGIT_TOL, and varlen is immune to that trap (its boundaries come from the layer's
    position_ids, whatever the cache)."""
    ref_logits = runs["one_by_one"][0]
    inputs = {k: v for k, v in runs["batch"].items() if k != "labels"}
    with torch.no_grad():
        set_attention_(model, "sdpa")
        naive = model(**inputs).logits  # use_cache on (the config's default): plain causal over the row
        assert model.config._attn_implementation == "sdpa"
        use_varlen_(model)
        assert model.config._attn_implementation == NAME
        trapped = model(**inputs).logits
    (b, s), first = next(iter(ref_logits.items()))
    assert (naive[b, s:s + len(first)] - first).abs().max() < LOGIT_TOL  # the row's first document sees nothing else
    later = [(naive[b, s:s + len(r)] - r).abs().max() for (b, s), r in ref_logits.items() if s > 0]
    assert min(later) > 100 * LOGIT_TOL
    for (b, s), r in ref_logits.items():
        assert (trapped[b, s:s + len(r)] - r).abs().max() < LOGIT_TOL


def test_padding_free_layout_equals_padded_rows(model):
    """The data layer's padding-free collator (a recipe's `padding_free: true`): ROWS' two rows as one row of their
    470 real tokens give the padded rows' loss (hfscale.models.loss.lm_loss: the sum over trained tokens / the step's
    count, as the recipes call it) and gradients under the varlen kernel, from the same trained-token count; the
    tolerances are this module's (the same documents in the same kernel groups, GEMMs over [1, 470] instead of
    [2, 256] tokens: fp32 sum order only). The same flat row with its positions counting straight through (the
    documents attending to the ones before them) is far outside them, so the comparison can fail."""
    from hfscale.data import PackedCollator
    from hfscale.models.documents import check_packed_batch
    from hfscale.models.loss import lm_loss, trained_tokens

    batch = packed_batch()
    rows = [{k: v[b, :sum(docs)] for k, v in batch.items()} for b, docs in enumerate(ROWS)]  # the store's rows
    padded, flat = PackedCollator(L)(rows), PackedCollator(padding_free=True)(rows)
    assert all(torch.equal(padded[k], batch[k]) for k in batch)
    assert flat["input_ids"].shape == (1, 470) and torch.equal(flat["labels"][0], torch.cat([r["labels"] for r in rows]))
    check_packed_batch(flat)
    n = trained_tokens(padded["labels"])
    assert trained_tokens(flat["labels"]) == n > 400
    naive = {**flat, "position_ids": torch.arange(470)[None]}
    set_attention_(model, "varlen")
    got = {}
    for name, b in (("padded", padded), ("flat", flat), ("naive", naive)):
        model.zero_grad(set_to_none=True)
        loss = lm_loss(model, b, n)
        loss.backward()
        got[name] = loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}
    (loss, grads), (ref, ref_grads), (bad, bad_grads) = got["flat"], got["padded"], got["naive"]
    assert abs(loss - ref) / ref < 1e-6 and grad_diff(grads, ref_grads) < GRAD_TOL
    # measured: flat vs padded loss equal to the bit, gradients 1.7e-7; the naive row 9.0e-4 (loss) and 0.96 (gradients)
    assert abs(bad - ref) / ref > 100 * 1e-6 and grad_diff(bad_grads, ref_grads) > 100 * GRAD_TOL


def reference(q, k, v, position_ids, window=None, scaling=None, softcap=None):
    """Attention written out: the block-diagonal causal (and windowed) mask of hfscale.models.documents."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~block_causal_mask(position_ids, window), float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


class Heads(torch.nn.Module):  # what the kernel reads from an attention module
    is_causal = True
    num_key_value_groups = 2


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_kernel_window_gqa_softcap(softcap):
    """The kernel alone: GQA (4 query heads over 2 K/V heads), a 16-token window inside documents of 90 and 60-63 tokens
    (>= 3 windows: the blocked path), of 20 (a masked band) and 13 (plain causal), scaling and tanh soft-capping,
    against the written-out reference."""
    register()
    g = torch.Generator().manual_seed(1)
    pos = packed_batch([[90, 13, 20], [60, 63]], 128)["position_ids"]
    q, k, v = (torch.randn(2, h, 128, 16, generator=g) for h in (4, 2, 2))
    for window in (None, 16):
        out, _ = varlen_attention(Heads(), q, k, v, None, scaling=0.3, sliding_window=window, softcap=softcap,
                                  position_ids=pos)
        assert (out - reference(q, k, v, pos, window, 0.3, softcap)).abs().max() < 1e-5
    windowed = varlen_attention(Heads(), q, k, v, None, sliding_window=16, position_ids=pos)[0]
    full = varlen_attention(Heads(), q, k, v, None, position_ids=pos)[0]
    assert (windowed[0, :16] == full[0, :16]).all()  # inside the window: the same attention
    assert (windowed[0, 16:90] - full[0, 16:90]).abs().amax(dim=(-1, -2)).min() > 1e-3  # beyond it: every token moves


def test_flash_kwargs_and_documents():
    """cu_seq_lens (flash's varlen arguments, as DataCollatorWithFlattening / flash_varlen_kwargs give them) find the
    same documents as position_ids; a document crossing a row is refused."""
    pos = packed_batch([[90, 13, 20], [60, 63]], 128)["position_ids"]
    fa = flash_varlen_kwargs(pos)
    assert documents(2, 128, pos) == documents(2, 128, cu_seq_lens=fa["cu_seq_lens_q"])
    assert documents(2, 128, pos) == ([0, 90, 103, 123, 128, 188, 251], [90, 13, 20, 5, 60, 63, 5])
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 128, 16, generator=g) for h in (4, 2, 2))
    a = varlen_attention(Heads(), q, k, v, None, position_ids=pos)[0]
    b = varlen_attention(Heads(), q, k, v, None, position_ids=torch.arange(128)[None], **fa)[0]
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="crosses a row boundary"):
        documents(2, 128, cu_seq_lens=torch.tensor([0, 100, 256], dtype=torch.int32))


def test_generation_unchanged(model):
    """Decoding (a cache, left padding) goes through transformers' sdpa on its own mask: the same logits as sdpa."""
    model.eval()
    try:
        ids = torch.randint(3, 4000, (2, 12), generator=torch.Generator().manual_seed(3))
        mask = torch.ones_like(ids)
        mask[1, :4] = 0
        kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
        got = {}
        for kernel in ("sdpa", "varlen"):
            set_attention_(model, kernel)
            with torch.no_grad():
                got[kernel] = model.generate(ids, **kw)
        assert torch.equal(got["sdpa"].sequences, got["varlen"].sequences)
        assert max((a - b).abs().max() for a, b in zip(got["sdpa"].logits, got["varlen"].logits)) < LOGIT_TOL
    finally:
        model.train()


def test_recipe_setting():
    from hfscale.train.config import TrainConfig
    from hfscale.util.errors import ConfigError

    assert TrainConfig(attention="varlen").attention == "varlen" and TrainConfig().attention is None
    with pytest.raises(ConfigError, match="use one of varlen, sdpa"):
        TrainConfig(attention="flash")


def test_padding_free_setting_needs_a_varlen_kernel_and_no_sp():
    """`padding_free: true` (TrainConfig, through load_recipe's coercion) only with a kernel that keeps one row's
    documents apart without a mask; refused under Ulysses SP and by the recipes that run the model's own kernel."""
    from hfscale.data.dataset import check_padding_free
    from hfscale.train.config import QATRecipeConfig, TrainConfig, load_recipe
    from hfscale.train.distill import DistillRecipeConfig
    from hfscale.util.errors import ConfigError

    assert load_recipe(None, {"padding_free": "true", "attention": "varlen"}).padding_free is True
    assert TrainConfig().padding_free is False
    for attention, needle in ((None, "under the model's own attention"), ("sdpa", "under attention sdpa")):
        with pytest.raises(ConfigError, match=f"{needle} .* set attention: varlen"):
            TrainConfig(padding_free=True, attention=attention)
    check_padding_free(True, "flash_attention_2")
    with pytest.raises(ConfigError, match="cannot run under Ulysses SP"):
        check_padding_free(True, "flash_attention_2", sp=2)
    for make, recipe in ((QATRecipeConfig, "qat_clm"), (lambda **kw: DistillRecipeConfig(teacher="t", **kw), "distill_clm")):
        with pytest.raises(ConfigError, match=f"{recipe} reads packed rows of seq_len"):
            make(padding_free=True)


def test_attention_choices_a_model_or_host_cannot_run_are_refused_before_training():
    """One line each, before anything is written (train_clm checks them with its parallel settings); qat_clm and
    distill_clm, which do not apply `attention:`, refuse it instead of ignoring it."""
    from transformers import Gemma3Config, Gemma3TextConfig, Llama4TextConfig

    from hfscale.models.varlen import check_attention
    from hfscale.train.config import QATRecipeConfig
    from hfscale.train.distill import DistillRecipeConfig
    from hfscale.util.errors import ConfigError

    check_attention("varlen", Gemma3TextConfig())  # a causal text model: fine
    for attention, config, needle in [
        ("varlen", Gemma3Config(), "causal text models; Gemma3Config has image tokens"),
        ("varlen", Llama4TextConfig(attention_chunk_size=8192), "chunked attention"),
        ("flash_attention_2", Gemma3TextConfig(), "needs a CUDA GPU and the flash_attn package"),
    ]:
        if attention.startswith("flash") and torch.cuda.is_available():
            continue  # a GPU host may have flash-attn: nothing to refuse there
        with pytest.raises(ConfigError, match=needle):
            check_attention(attention, config)
    with pytest.raises(ConfigError, match="qat_clm runs the model's own attention kernel"):
        QATRecipeConfig(attention="varlen")
    with pytest.raises(ConfigError, match="distill_clm runs the models' own attention kernel"):
        DistillRecipeConfig(teacher="t", attention="varlen")
