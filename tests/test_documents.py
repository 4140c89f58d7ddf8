"""Packed batches (hfscale.models.documents) and the loss over trained tokens (hfscale.models.loss), on CPU.

A packed row's loss and gradients equal those of its documents run one by one, for the built-in tiny Gemma 3
and three zoo families (Gemma 4, Llama, Qwen 3), sdpa and eager; the same tokens concatenated without
boundaries, and the packed batch through transformers' default train-mode forward (which makes a cache and so
skips its packed-sequence detection), differ by more than the tolerance. Untrained tokens contribute exactly
zero; two micro batches normalised by the step's count equal one batch's sum / count; flash-attention's varlen
arguments equal transformers' own; the Ulysses split keeps every boundary; the step loop, evaluation,
distillation, scoring and the tiled loss use the step's count. One process, no launch.
"""

from __future__ import annotations

import pytest
import torch

from hfscale.models.documents import (block_causal_mask, check_packed_batch, document_ids, flash_varlen_kwargs,
                                      forward_kwargs, respect_documents_)
from hfscale.models.loss import global_trained_tokens, lm_loss, token_nll, trained_tokens

# two rows of 160 tokens: row 0 = documents of 100 and 50 tokens + 10 of padding (its own dummy document);
# row 1 = 30, 1, 89 and 40 tokens. 100 and 89 are longer than Gemma 3's window (64) and the zoo Gemma 4's (32),
# so the sliding layers' window inside a document is exercised too.
ROWS = [[100, 50], [30, 1, 89, 40]]
PAD = [10, 0]
PROMPT = 40  # the first 40 tokens of the first document are an untrained prompt
L = 160

# fp32 throughout. The packed and the one-by-one forward compute the same sums, but over matrices of other
# shapes (160 vs 1..100 rows), so the CPU kernels may block and order the reductions differently (and sdpa's
# threads differ from run to run); masked keys add exact zeros (sdpa: -inf -> exp 0; eager: dtype-min + score
# underflows to 0). A forward output of the 4-layer model is a chain of ~10 reductions of <= 256 terms; fp32
# rounding is 6e-8 relative per add: random-sign errors give ~sqrt(256) x 6e-8 ~ 1e-6 per reduction, ~3e-6
# over the chain, on the loss; 1e-5 is the tolerance. Gradients add the backward chain (~2x as long) and the
# embedding rows' sums over up to 320 positions in another order: worst case 320 x 6e-8 ~ 2e-5 per sum, ~20 in
# a chain, ~4e-4 relative to the largest gradient; 5e-4 is the tolerance. Measured here (AVX512, 8 cases):
# loss <= 1.2e-7 relative, gradients <= 2.6e-5 (Gemma 4 sdpa's per-layer embedding; others <= 1.3e-6).
# Missing boundaries move the loss by 3.4e-4 (Llama) .. 1.1e-2 (Gemma 3) relative -- the check asks for more
# than 10x the tolerance (init scaled so attention is not near-uniform: see _model).
LOSS_RTOL, GRAD_RTOL = 1e-5, 5e-4

def _model(family: str, impl: str):
    from transformers import AutoModelForCausalLM

    from hfscale.testing.zoo import ARCHITECTURES

    cfg = ARCHITECTURES[family]()
    cfg.initializer_range = 0.1  # sharper attention than the default 0.02, so attending across documents shows
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().train()  # train mode: what a training step runs


def _batch(vocab: int):
    """The packed batch by the contract, and each document with its own labels."""
    g = torch.Generator().manual_seed(1)
    rows, docs = [], []
    for lens, pad in zip(ROWS, PAD):
        ids, labels, pos = [], [], []
        for j, n in enumerate(lens):
            d = torch.randint(3, vocab, (n,), generator=g)
            lab = d.clone()
            lab[0] = -100  # a document's first token is never trained
            if not rows and j == 0:
                lab[:PROMPT] = -100
            docs.append((d, lab))
            ids.append(d), labels.append(lab), pos.append(torch.arange(n))
        ids.append(torch.zeros(pad, dtype=torch.long)), labels.append(torch.full((pad,), -100)), pos.append(torch.arange(pad))
        rows.append((torch.cat(ids), torch.cat(labels), torch.cat(pos)))
    batch = {k: torch.stack([r[i] for r in rows]) for i, k in enumerate(("input_ids", "labels", "position_ids"))}
    check_packed_batch(batch)
    return batch, docs


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _one_by_one(model, docs, n):
    model.zero_grad()
    total = sum(token_nll(model(input_ids=d[None], use_cache=False).logits, lab[None])[0] for d, lab in docs) / n
    total.backward()
    return total.detach(), _grads(model)


def _packed(model, batch, n):
    model.zero_grad()
    loss = lm_loss(model, batch, n)
    loss.backward()
    return loss.detach(), _grads(model)


def _loss_only(model, batch, n, **call):
    with torch.no_grad():
        return model(**batch, **call, num_items_in_batch=n).loss


def _close(a, b, rtol):
    return float((a - b).abs().max()) <= rtol * float(b.abs().max())


# Gemma 3 (sliding + full layers) and Llama with both kernels; Gemma 4 (per-layer inputs, KV sharing, window 32)
# and Qwen 3 on sdpa (the mask code is the same for both kernels: eager adds it as floats)
@pytest.mark.parametrize("family,impl", [("gemma3", "sdpa"), ("gemma3", "eager"), ("llama", "sdpa"), ("llama", "eager"),
                                         ("gemma4", "sdpa"), ("qwen3", "sdpa")])
def test_packed_rows_equal_their_documents_one_by_one(family, impl):
    model = _model(family, impl)
    batch, docs = _batch(model.config.vocab_size)
    n = int(trained_tokens(batch["labels"]))
    assert n == sum(int((lab[1:] != -100).sum()) for _, lab in docs) == 60 + 49 + 29 + 0 + 88 + 39
    ref_loss, ref_grad = _one_by_one(model, docs, n)
    loss, grad = _packed(model, batch, n)
    assert _close(loss, ref_loss, LOSS_RTOL), (float(loss), float(ref_loss))
    assert _close(grad, ref_grad, GRAD_RTOL), float((grad - ref_grad).abs().max() / ref_grad.abs().max())

    # the same tokens with no boundaries (positions 0..L-1, one causal row each): the test can fail
    naive = {**batch, "position_ids": torch.arange(L).expand(2, L)}
    naive_loss = _loss_only(model, naive, n, use_cache=False)
    assert not _close(naive_loss, ref_loss, 10 * LOSS_RTOL), (float(naive_loss), float(ref_loss))
    # transformers alone, default train-mode forward: it makes a cache, skips find_packed_sequence_indices and
    # runs the rows plain causal -- the documents attend across (why forward_kwargs passes use_cache=False)
    default_loss = _loss_only(model, batch, n)
    assert not _close(default_loss, ref_loss, 10 * LOSS_RTOL), (float(default_loss), float(ref_loss))


def test_model_call_with_the_hook_keeps_documents_apart():
    """`model(**batch)` as transformers' Trainer calls it: with respect_documents_ the packed rows equal their
    documents; the hook only fills in what the call did not set."""
    model = _model("gemma3", "sdpa")
    batch, docs = _batch(model.config.vocab_size)
    n = int(trained_tokens(batch["labels"]))
    ref_loss, _ = _one_by_one(model, docs, n)
    handle = respect_documents_(model)
    with torch.no_grad():
        hooked = model(**batch, num_items_in_batch=n).loss
    handle.remove()
    with torch.no_grad():
        bare = model(**batch, num_items_in_batch=n).loss
    assert _close(hooked, ref_loss, LOSS_RTOL)
    assert not _close(bare, ref_loss, 10 * LOSS_RTOL)


def test_untrained_tokens_contribute_exactly_zero():
    """Positions whose next label is -100 (the prompt, padding, a document's last token before the next one)
    get exactly zero gradient in the logits and add exactly nothing to the summed loss."""
    model = _model("llama", "sdpa")
    batch, _ = _batch(model.config.vocab_size)
    logits = model(**forward_kwargs({k: v for k, v in batch.items() if k != "labels"}, "sdpa")).logits
    logits.retain_grad()
    nll, count = token_nll(logits, batch["labels"])
    (nll / count).backward()
    untrained = torch.nn.functional.pad(batch["labels"][:, 1:] == -100, (0, 1), value=True)  # position t predicts t+1
    assert int(untrained.sum()) == 2 * L - int(count)
    assert torch.equal(logits.grad[untrained], torch.zeros_like(logits.grad[untrained]))  # exact, not close
    assert (logits.grad[~untrained].abs().sum(-1) > 0).all()
    # the summed NLL over trained positions only: changing every untrained position's logits changes nothing
    other = logits.detach().clone()
    other[untrained] = torch.randn_like(other[untrained])
    assert torch.equal(token_nll(other, batch["labels"])[0], nll.detach())


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_head_runs_at_trained_positions_only(family):
    """lm_loss hands the LM head the trained positions only: its logits are [1, N, V] for the N trained tokens
    of the two rows (265 of 320 positions), and the loss and gradients equal the model's own loss over the full
    [2, 160, V] logits (Gemma 3 with its final soft-capping on: 30.0 set here). A head given one position too
    many or too few, or the wrong ones, moves the loss by far more than the tolerance (the model's own loss of
    the same batch with its labels shifted by one is checked to differ). The hook is gone afterwards."""
    model = _model(family, "sdpa")
    if family == "gemma3":
        model.config.final_logit_softcapping = 30.0
    batch, _ = _batch(model.config.vocab_size)
    n = int(trained_tokens(batch["labels"]))
    head, shapes = model.get_output_embeddings(), []
    seen = head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    loss, grads = _packed(model, batch, n)
    seen.remove()
    assert n == 265 and shapes == [(1, n, model.config.vocab_size)] and not head._forward_pre_hooks
    model.zero_grad()
    ref = model(**forward_kwargs(batch, "sdpa"), num_items_in_batch=n).loss
    ref.backward()
    assert _close(loss, ref.detach(), LOSS_RTOL) and _close(grads, _grads(model), GRAD_RTOL)
    off = {**batch, "labels": torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)}
    assert not _close(_loss_only(model, forward_kwargs(off, "sdpa"), n), ref.detach(), 10 * LOSS_RTOL)


def test_a_micro_batch_that_trains_nothing_still_runs_and_adds_zero():
    """No trained token (a packed row of masked prompts): the loss is 0.0 with a graph (every parameter's gradient
    zero, backward runs: under ZeRO-3 / FSDP2 each rank must take part in every forward and backward), the head
    given [1, 0, h]. loop.evaluate runs it too rather than skipping the forward on that rank alone."""
    model = _model("gemma3", "sdpa")
    batch, _ = _batch(model.config.vocab_size)
    batch = {**batch, "labels": torch.full_like(batch["labels"], -100)}
    loss = lm_loss(model, batch, 1)
    loss.backward()
    assert loss.item() == 0.0 and loss.grad_fn is not None
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_a_trained_count_that_is_not_the_labels_is_refused():
    """The count trained_positions is handed (for fake tensors, which cannot be read) is checked against real labels:
    a smaller one would drop trained tokens silently, a larger one pad the gather."""
    from hfscale.models.loss import trained_positions
    from hfscale.util.errors import HfscaleError

    labels = torch.tensor([[-100, 1, 2, -100, 3]])  # positions 0, 1, 3 predict a trained token
    index, targets = trained_positions(labels)
    assert index.tolist() == [0, 1, 3] and targets.tolist() == [1, 2, 3]
    assert trained_positions(labels, 3)[0].tolist() == [0, 1, 3]
    for wrong in (2, 4):
        with pytest.raises(HfscaleError, match=f"told {wrong} trained tokens where the labels train 3"):
            trained_positions(labels, wrong)


def test_a_mixture_of_experts_keeps_its_router_loss():
    """A mixture of experts asked for its router logits adds its load-balancing loss to the loss it computes: lm_loss
    takes the model's own loss there (hfscale.models.loss.own_loss), equal to it to the bit; the cross-entropy alone
    (the head cut to the trained positions) differs by the auxiliary term, so the test can fail."""
    model = _model("qwen3_moe", "sdpa")
    model.config.output_router_logits = True
    batch, _ = _batch(model.config.vocab_size)
    n = int(trained_tokens(batch["labels"]))
    with torch.no_grad():
        out = model(**forward_kwargs(batch, "sdpa"), num_items_in_batch=n)
        assert out.aux_loss is not None and out.aux_loss.item() > 0
        assert torch.equal(lm_loss(model, batch, n), out.loss)
        model.config.output_router_logits = False
        assert not _close(lm_loss(model, batch, n), out.loss, LOSS_RTOL)


def test_two_micro_batches_normalise_by_the_step_count():
    """Micro batches of 20 and of 156 trained tokens: the shares over the step's count add up to the one batch's
    sum / count (and its gradient); the mean of the two means does not."""
    model = _model("gemma3", "eager")
    batch, _ = _batch(model.config.vocab_size)
    row0 = {k: v[:1] for k, v in batch.items()}
    short = {**row0, "labels": row0["labels"].clone()}
    short["labels"][0, 60:] = -100  # row 0 keeps 20 trained tokens (40..59 of its first document)
    long = {k: v[1:] for k, v in batch.items()}
    both = {k: torch.cat([short[k], long[k]]) for k in batch}
    n1, n2 = int(trained_tokens(short["labels"])), int(trained_tokens(long["labels"]))
    assert (n1, n2) == (20, 156)
    n = global_trained_tokens([short["labels"], long["labels"]])  # not distributed: the local sum
    assert n == n1 + n2

    model.zero_grad()
    for mb in (short, long):
        lm_loss(model, mb, n).backward()  # accumulate as a loop does
    step_grad = _grads(model).clone()
    model.zero_grad()
    with torch.no_grad():
        step_loss = sum(lm_loss(model, mb, n) for mb in (short, long))
    whole = lm_loss(model, both)  # one batch: transformers' own mean over its labelled tokens
    whole.backward()
    assert _close(step_loss, whole.detach(), LOSS_RTOL)
    assert _close(step_grad, _grads(model), GRAD_RTOL)
    with torch.no_grad():
        mean_of_means = (lm_loss(model, short) + lm_loss(model, long)) / 2
    assert not _close(mean_of_means, whole.detach(), 10 * LOSS_RTOL)


def test_full_blocks_keep_the_old_loss():
    """A Long[B, S] tensor (labels = inputs) is scored as before: transformers' mean, bit for bit."""
    model = _model("gemma3", "eager")
    ids = torch.randint(3, 4096, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(lm_loss(model, ids), model(input_ids=ids, labels=ids).loss)


def test_flash_varlen_kwargs_values():
    """The varlen arguments over the flattened B x L tokens equal transformers' own from the same position ids
    (prepare_fa_kwargs_from_position_ids) and the hand count. Not run on a flash kernel (CPU host)."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4, 5, 0]])
    kw = flash_varlen_kwargs(pos)
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 5, 9, 11, 17, 18] and kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"] and kw["max_length_q"] == kw["max_length_k"] == 6
    (cu, _), (mx, _) = prepare_fa_kwargs_from_position_ids(pos)
    assert torch.equal(cu, kw["cu_seq_lens_q"]) and int(mx) == 6
    batch = {"input_ids": pos, "labels": pos, "position_ids": pos}
    assert set(forward_kwargs(batch, "flash_attention_2")) == set(batch) | set(kw) | {"use_cache"}
    assert set(forward_kwargs(batch, "sdpa")) == set(batch) | {"use_cache"}


def test_block_causal_mask_and_document_ids():
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 0]])
    assert document_ids(pos).tolist() == [[0, 0, 0, 0, 1, 1, 2]]
    m = block_causal_mask(pos)[0, 0]
    assert m[3, 0] and not m[4, 3] and m[5, 4] and not m[6, 5] and m[6, 6] and not m[0, 1]
    w = block_causal_mask(pos, sliding_window=2)[0, 0]
    assert w[3, 2] and not w[3, 1] and w[5, 4]
    assert int(m.sum()) == 4 * 5 // 2 + 3 + 1


def test_contract_refusals():
    pos = torch.tensor([[0, 1, 2, 0]])
    ok = {"input_ids": pos, "labels": torch.tensor([[-100, 1, 2, -100]]), "position_ids": pos}
    check_packed_batch(ok)
    for bad, why in [({**ok, "attention_mask": pos}, "exactly"), ({**ok, "labels": pos}, "first token"),
                     ({**ok, "position_ids": torch.tensor([[1, 2, 3, 4]])}, "start a document"),
                     ({**ok, "position_ids": torch.tensor([[0, 1, 3, 0]])}, "restart at 0")]:
        with pytest.raises(ValueError, match=why):
            check_packed_batch(bad)


@pytest.mark.parametrize("sp", [2, 4])
def test_ulysses_split_keeps_the_boundaries(sp):
    """What sp_lm_loss gives each SP rank (its slice of tokens, shifted labels and position ids), gathered back
    as DeepSpeed's attention all-gathers position_ids: the same documents, the same block mask, every trained
    target kept exactly once (the labels are shifted before the split)."""
    from hfscale.scale.ulysses import needs_mask, sp_shard_inputs

    batch, _ = _batch(4096)
    ids, labels, pos = sp_shard_inputs(batch)
    S = ids.shape[1]
    shards = [(ids[:, r * S // sp:(r + 1) * S // sp], labels[:, r * S // sp:(r + 1) * S // sp],
               pos[:, r * S // sp:(r + 1) * S // sp]) for r in range(sp)]
    gathered = torch.cat([s[2] for s in shards], dim=1)
    assert torch.equal(gathered, batch["position_ids"])
    assert torch.equal(block_causal_mask(gathered, 64), block_causal_mask(batch["position_ids"], 64))
    assert sum(int((s[1] != -100).sum()) for s in shards) == int(trained_tokens(batch["labels"]))
    assert torch.equal(torch.cat([s[1] for s in shards], 1)[:, :-1], batch["labels"][:, 1:])
    assert needs_mask(gathered, None) and not needs_mask(torch.arange(S).expand(2, S), None)


def test_window_sdpa_rebuilds_document_masks_when_the_kernel_gets_none():
    """Under Ulysses the attention function is called with no mask and the gathered position ids. A kernel
    registered beside sdpa that gets no mask from transformers (it has no mask interface) and runs
    use_window_sdpa's function: the packed rows still equal their documents (Gemma 3: sliding and full layers)."""
    from transformers import AttentionInterface

    from hfscale.scale.ulysses import use_window_sdpa
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    try:
        fn = use_window_sdpa()
        AttentionInterface.register("hfscale_nomask", fn)
        model = _model("gemma3", "hfscale_nomask")
        batch, docs = _batch(model.config.vocab_size)
        n = int(trained_tokens(batch["labels"]))
        ref_loss, ref_grad = _one_by_one(model, docs, n)
        loss, grad = _packed(model, batch, n)
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)
    assert _close(loss, ref_loss, LOSS_RTOL) and _close(grad, ref_grad, GRAD_RTOL)


def _micro_pair(model):
    """Two micro batches of one row each with 20 and 156 trained tokens (see _batch)."""
    batch, _ = _batch(model.config.vocab_size)
    short = {k: v[:1].clone() for k, v in batch.items()}
    short["labels"][0, 60:] = -100
    return short, {k: v[1:] for k, v in batch.items()}


def test_train_steps_packed_step_is_the_gradient_of_sum_over_count(tmp_path, fresh_accelerate):
    """hfscale.train.loop.train_steps with read_batch / step_tokens, under a real (1-process) Accelerator with 2
    accumulation steps and SGD: the update is -lr x the gradient of the step's sum / N (accelerate divides each
    backward by 2, backward_scale multiplies by accum x ranks), and the logged loss is the step's sum / N."""
    import copy

    from accelerate import Accelerator

    from hfscale.data.sampler import BatchPlan
    from hfscale.train.config import TrainConfig
    from hfscale.train.loop import train_steps
    from hfscale.train.metrics import MetricsLog, read_records
    from hfscale.train.state import Checkpoints

    model = _model("llama", "sdpa")
    short, long = _micro_pair(model)
    n = int(trained_tokens(short["labels"]) + trained_tokens(long["labels"]))
    ref = copy.deepcopy(model)
    ref.zero_grad()
    expected = sum(lm_loss(ref, mb, n) for mb in (short, long))
    expected.backward()

    lr = 0.5
    cfg = TrainConfig(max_steps=1, lr=lr, warmup_steps=0, min_lr_ratio=1.0, max_grad_norm=1e9, save_every=0,
                      eval_every=0, progress=False, output_dir=str(tmp_path), doctor=False)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    before = [p.detach().clone() for p in model.parameters()]
    prepared, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=lr))
    log = MetricsLog(tmp_path / "metrics.jsonl")
    train_steps(acc, prepared, opt, cfg, BatchPlan(1, 2, 1, L), None, None, Checkpoints(tmp_path / "ck", 1), log, 0, {},
                read_batch=lambda step, micro, rank: (short, long)[micro], step_tokens=lambda step: n)
    update = torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, model.parameters())])
    assert _close(update, lr * _grads(ref), GRAD_RTOL)
    rec = read_records(tmp_path / "metrics.jsonl")[1]
    expected = float(expected.detach())
    assert abs(rec["loss"] - expected) <= LOSS_RTOL * expected and rec["trained_tokens"] == n == 176


def test_evaluate_weighs_packed_batches_by_their_trained_tokens(fresh_accelerate):
    from accelerate import Accelerator

    from hfscale.train.loop import evaluate

    model = _model("gemma3", "sdpa")
    short, long = _micro_pair(model)
    nll = [token_nll(model(**forward_kwargs({k: v for k, v in mb.items() if k != "labels"}, "sdpa")).logits,
                     mb["labels"]) for mb in (short, long)]
    want = float(sum(x for x, _ in nll) / sum(c for _, c in nll))
    got = evaluate(model, Accelerator(cpu=True), [short, long], micro_batch=1)
    assert abs(got - want) <= LOSS_RTOL * want
    assert abs(got - float(sum(x / c for x, c in nll) / 2)) > 10 * LOSS_RTOL * want  # not a mean of means


def test_distillation_and_score_count_trained_positions_only():
    """CE and KL over trained positions only (/ the denominator when given); compress.evaluate.score the same."""
    from hfscale.compress.evaluate import score
    from hfscale.compress.qat import distillation_loss

    g = torch.Generator().manual_seed(3)
    s, t = torch.randn(2, 16, 50, generator=g), torch.randn(2, 16, 50, generator=g)
    labels = torch.randint(0, 50, (2, 16), generator=g)
    labels[0, :9] = -100
    keep = labels[:, 1:] != -100
    ls, lt = torch.log_softmax(s[:, :-1] / 2, -1)[keep], torch.log_softmax(t[:, :-1] / 2, -1)[keep]
    kl = (lt.exp() * (lt - ls)).sum() / 20
    ce = torch.nn.functional.cross_entropy(s[:, :-1][keep], labels[:, 1:][keep], reduction="sum") / 20
    got = distillation_loss(s, t, labels, 0.25, temperature=2.0, denominator=20)
    assert torch.allclose(got, 0.75 * ce + 0.25 * 4 * kl, rtol=1e-5)
    assert int(keep.sum()) == 22  # 20 above is a step's count, not this batch's

    model = _model("qwen3", "sdpa").eval()
    short, long = _micro_pair(model)
    nll, count, _ = score(model, [short, long])
    assert count == 176
    with torch.no_grad():
        assert abs(nll - sum(float(lm_loss(model, mb, 1)) for mb in (short, long))) <= LOSS_RTOL * nll


def test_tiled_loss_takes_the_step_denominator():
    """hfscale.scale.long_context.tile_loss_ on a packed batch with the step's count equals the untiled loss."""
    from hfscale.scale.long_context import tile_loss_

    model = _model("gemma3", "sdpa")
    batch, _ = _batch(model.config.vocab_size)
    with torch.no_grad():
        plain = lm_loss(model, batch, 300)
        tile_loss_(model, 4)
        tiled = lm_loss(model, batch, 300)
    assert abs(float(tiled) - float(plain)) <= LOSS_RTOL * float(plain)


def test_sp_lm_loss_of_a_packed_batch_on_one_rank():
    """hfscale.scale.ulysses.sp_lm_loss on a packed batch with the step's count, over a real 1-rank gloo group (the
    collectives run; the split is the identity): loss and gradients equal the documents one by one."""
    import torch.distributed as dist

    from hfscale.scale.ulysses import sp_lm_loss

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _model("gemma3", "sdpa")
        batch, docs = _batch(model.config.vocab_size)
        n = int(trained_tokens(batch["labels"]))
        ref_loss, ref_grad = _one_by_one(model, docs, n)
        model.zero_grad()
        loss = sp_lm_loss(dist.group.WORLD)(model, batch, n)
        loss.backward()
        assert _close(loss.detach(), ref_loss, LOSS_RTOL) and _close(_grads(model), ref_grad, GRAD_RTOL)
        assert global_trained_tokens([batch["labels"]], dist.group.WORLD) == n
        with torch.no_grad():  # full blocks: the mean over every next token, as before
            ids = batch["input_ids"]
            assert _close(sp_lm_loss(dist.group.WORLD)(model, ids), lm_loss(model, ids), LOSS_RTOL)
    finally:
        dist.destroy_process_group()
