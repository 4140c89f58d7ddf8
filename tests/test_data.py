"""hfscale.data (issue 36): formats and loss masks from the rendered template, the template checks, packing,
the token store (content key, built by 2 plain processes, refusals, kill -9, full disk), the batch contract of
the collator, the sampler's trained-token count, and transformers' Trainer reading a store. Small data: each
test runs in seconds on the 2-core host."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import snapshot
from hfscale.data import DataOptions, PackedCollator, PackedDataset, TokenStore, open_info, prepare
from hfscale.data.formats import Tok, check_example, data_tokenizer, encode
from hfscale.data.packing import pack
from hfscale.data.sampler import plan_batch, rank_indices, step_rows, step_trained
from hfscale.util.errors import HfscaleError

ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": "A mutable sequence."}, {"role": "user", "content": "And a tuple?"},
        {"role": "assistant", "content": "An immutable one."}]


@pytest.fixture(scope="module")
def tok():
    return Tok.of(data_tokenizer("tiny-gemma3"))


def trained_text(tok, enc):
    return tok.tokenizer.decode([i for i, m in zip(enc.ids, enc.mask) if m])


# --- formats and masks ------------------------------------------------------------------------------


def test_chat_masks_come_from_the_rendered_template(tok):
    assert tok.terminator == "<end_of_turn>"  # found by rendering a probe conversation, not configured
    full = encode({"messages": CHAT}, "messages", tok, "assistant", "x")
    check_example(full, tok, "x")
    # exactly the assistant turns, each with its terminator; system / user turns and the generation prompts untrained
    assert trained_text(tok, full) == "A mutable sequence.<end_of_turn>\nAn immutable one.<end_of_turn>\n"
    assert full.ids[0] == tok.bos and full.ids.count(tok.bos) == 1 and full.mask[0] == 0
    assert trained_text(tok, encode({"messages": CHAT}, "messages", tok, "last", "x")) == "An immutable one.<end_of_turn>\n"
    assert all(encode({"messages": CHAT}, "messages", tok, "all", "x").mask)


def test_prompt_completion_plain_and_conversational(tok):
    plain = encode({"prompt": "Q: what is 2+2?", "completion": " 4"}, "prompt_completion", tok, "completion", "x")
    check_example(plain, tok, "x")
    assert plain.ids[0] == tok.bos and plain.ids[-1] == tok.eos
    assert trained_text(tok, plain) == " 4<eos>"  # the completion and EOS, never the prompt
    conv = encode({"prompt": CHAT[:4], "completion": CHAT[4:]}, "prompt_completion", tok, "completion", "x")
    assert trained_text(tok, conv) == "An immutable one.<end_of_turn>\n"  # the earlier assistant turn is prompt


def test_pretokenized_labels_and_text(tok):
    ids = [tok.bos, 300, 301, 302, tok.eos]
    enc = encode({"input_ids": ids, "labels": [-100, -100, 301, 302, tok.eos]}, "tokenized", tok, "all", "x")
    assert enc.mask == [0, 0, 1, 1, 1]
    with pytest.raises(HfscaleError, match="labels must"):
        encode({"input_ids": ids, "labels": [-100, 7, 301, 302, tok.eos]}, "tokenized", tok, "all", "x")
    text = encode({"text": "Lists are mutable."}, "text", tok, "all", "x")
    assert text.ids[0] == tok.bos and text.ids[-1] == tok.eos and all(text.mask)


def test_checks_catch_doubled_bos_untrained_terminator_and_empty_mask(tok):
    from hfscale.data.formats import Encoded

    good = encode({"messages": CHAT[1:3]}, "messages", tok, "assistant", "x")
    with pytest.raises(HfscaleError, match="doubled BOS"):
        check_example(Encoded([tok.bos] + good.ids, [0] + good.mask, chat=True), tok, "x")
    # the terminator's tokens left out of the trained run (what a {% generation %}-less mask does): refused
    cut = list(good.mask)
    last = max(i for i, m in enumerate(cut) if m)
    for i in range(last - 6, last + 1):
        cut[i] = 0
    with pytest.raises(HfscaleError, match="without its terminator"):
        check_example(Encoded(good.ids, cut, chat=True), tok, "x")
    with pytest.raises(HfscaleError, match="empty loss mask"):
        check_example(encode({"messages": CHAT[:2]}, "messages", tok, "assistant", "x"), tok, "x")
    # a template that writes nothing after an assistant turn cannot teach the model to stop
    bare = data_tokenizer("tiny-gemma3")
    bare.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    t2 = Tok.of(bare)
    with pytest.raises(HfscaleError, match="writes nothing after an assistant turn"):
        check_example(encode({"messages": CHAT[1:3]}, "messages", t2, "assistant", "x"), t2, "x")
    # the template writes {{ bos_token }} and the data starts with one more: the first token pair is two BOS
    double = data_tokenizer("tiny-gemma3")
    double.chat_template = "{{ bos_token }}" + double.chat_template
    t3 = Tok.of(double)
    with pytest.raises(HfscaleError, match="doubled BOS"):
        check_example(encode({"messages": CHAT[1:3]}, "messages", t3, "assistant", "x"), t3, "x")


# --- packing ---------------------------------------------------------------------------------------


def test_bfd_packs_every_document_once_deterministically():
    rng = np.random.default_rng(0)
    lens = rng.integers(5, 200, size=500)
    a, b = pack(lens, 256, "bfd"), pack(lens, 256, "bfd")
    assert np.array_equal(a.segments, b.segments) and np.array_equal(a.row_ptr, b.row_ptr)
    assert sorted(a.segments[:, 0].tolist()) == list(range(500))  # each document exactly once, whole
    assert np.array_equal(a.segments[:, 2], lens[a.segments[:, 0]]) and not a.segments[:, 1].any()
    per_row = np.add.reduceat(a.segments[:, 2], a.row_ptr[:-1])
    assert per_row.max() <= 256
    # bfd's rows are at least as full as one per row and (here) nearly full: 51,468 tokens need >= 202 rows
    assert a.rows <= int(np.ceil(lens.sum() / 256)) + 2 and a.efficiency > 0.98
    none = pack(lens, 256, "none")
    assert none.rows == 500 and none.efficiency < a.efficiency


def test_wrapped_cuts_the_stream_into_full_rows():
    lens = np.array([5, 3, 9, 1, 7])
    p = pack(lens, 4, "wrapped")
    assert p.rows == 25 // 4 and p.efficiency == 1.0
    assert np.add.reduceat(p.segments[:, 2], p.row_ptr[:-1]).tolist() == [4] * 6
    # row 1 = tokens 4..8 of the stream: the last token of doc 0, then doc 1 (3 tokens)
    assert p.segments[p.row_ptr[1]:p.row_ptr[2]].tolist() == [[0, 4, 1], [1, 0, 3]]


# --- the store -------------------------------------------------------------------------------------


def write_chat(path, n, seed=0):
    rng = np.random.default_rng(seed)
    words = "list tuple dict set string bytes module class function import loop value".split()
    with open(path, "w") as f:
        for i in range(n):
            q = " ".join(rng.choice(words, int(rng.integers(2, 12))))
            a = " ".join(rng.choice(words, int(rng.integers(1, 30))))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{i}: {q}?"},
                                             {"role": "assistant", "content": a + "."}]}) + "\n")


@pytest.fixture(scope="module")
def chat_store(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("chat")
    write_chat(d / "chat.jsonl", 300)
    info = prepare(str(d / "chat.jsonl"), tok.tokenizer, DataOptions(seq_len=128), d / "store")
    return d, info


def test_store_contract_and_counts(chat_store, tok):
    d, info = chat_store
    s = info.splits["train"]
    assert info.options == {"format": "messages", "train_on": "assistant", "packing": "bfd", "overflow": "truncate",
                            "seq_len": 128}
    assert s.examples + info.splits["validation"].examples == 300 and 0 < info.splits["validation"].examples < 40
    assert 0 < s.trained < s.tokens and s.efficiency > 0.9
    ds = PackedDataset(info.path)
    batch = PackedCollator(128, pad_id=tok.tokenizer.pad_token_id)([ds[i] for i in range(len(ds))])
    assert set(batch) == {"input_ids", "labels", "position_ids"} and batch["input_ids"].shape == (len(ds), 128)
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    starts = pos == 0
    assert (labels[starts] == -100).all()  # no token is predicted across a document boundary
    assert (ids[starts & (ids != tok.tokenizer.pad_token_id)] == tok.bos).all()  # every document starts at its BOS
    trained = labels != -100
    assert (labels[trained] == ids[trained]).all()
    assert int(trained.sum()) == s.trained == int(np.asarray(ds.store.row_trained).sum())
    # each document's trained tokens are its assistant turn: decoded, they end on the terminator
    text = tok.tokenizer.decode(ids[0][trained[0]].tolist())
    assert text.count("<end_of_turn>") == int(((pos[0] == 0) & (ids[0] == tok.bos)).sum())
    # padding: its own run of positions from 0, all -100
    b = int((ids[-1] != tok.tokenizer.pad_token_id).sum())
    if b < 128:
        assert pos[-1, b] == 0 and (labels[-1, b:] == -100).all()


def test_sampler_counts_a_steps_trained_tokens_without_communication(chat_store):
    d, info = chat_store
    ds = PackedDataset(info.path)
    plan2, plan1 = plan_batch(128 * 8, 128, 2, 2), plan_batch(128 * 8, 128, 1, 4)
    n = len(ds)
    for step in (0, 3):
        total = sum(int((PackedCollator(128)([ds[int(i)] for i in rank_indices(plan2, n, 5, step, a, r)])["labels"] != -100).sum())
                    for a in range(plan2.accum) for r in range(2))
        assert step_trained(plan2, ds.store.row_trained, 5, step) == total
        # the same rows at any world size: a resume 2 -> 1 rank reads the uninterrupted run's rows
        assert sorted(step_rows(plan2, n, 5, step).tolist()) == sorted(step_rows(plan1, n, 5, step).tolist())


def test_step_reader_counts_what_the_loss_sums_over(chat_store):
    """train_clm's read_batch / step_tokens (StepReader) on the first 40 rows only (max_train_blocks): the step's
    count is the sum of hfscale.models.loss.trained_tokens (labels[:, 1:] != -100) over every micro batch and rank
    it hands out, so the loss's denominator is exactly the number of tokens it sums over; MicroBatches covers the
    rows once, in order."""
    from hfscale.data.dataset import MicroBatches, StepReader
    from hfscale.models.loss import trained_tokens

    d, info = chat_store
    ds = PackedDataset(info.path, limit=40)
    plan = plan_batch(128 * 8, 128, 2, 2)
    reader = StepReader(ds, plan, 5)
    for step in (0, 2, 7):  # 7 x 8 rows > 40: the order wraps into the next epoch of the 40 rows
        batches = [reader.batch(step, a, r) for a in range(plan.accum) for r in range(plan.world)]
        assert all((b["labels"][:, 0] == -100).all() for b in batches)  # the contract: nothing predicts a row's first
        assert reader.trained(step) == sum(int(trained_tokens(b["labels"])) for b in batches) > 0
    # padding-free (a recipe's padding_free: true): each micro batch one row of its rows' real tokens, the same count
    flat = StepReader(ds, plan, 5, PackedCollator(padding_free=True))
    for step in (0, 7):
        for a in range(plan.accum):
            b, f = reader.batch(step, a, 1), flat.batch(step, a, 1)
            lengths = [len(ds[int(i)]["input_ids"]) for i in rank_indices(plan, len(ds), 5, step, a, 1)]
            real = torch.arange(128)[None] < torch.tensor(lengths)[:, None]  # each row's tokens before its padding
            assert f["input_ids"].shape == (1, int(real.sum())) and torch.equal(f["input_ids"][0], b["input_ids"][real])
            assert torch.equal(f["labels"][0], b["labels"][real]) and trained_tokens(f["labels"]) == trained_tokens(b["labels"])
    val = MicroBatches(ds, 3)
    assert len(val) == 14 and val[13]["input_ids"].shape[0] == 1  # 13 x 3 + 1 rows
    assert torch.equal(torch.cat([val[j]["input_ids"] for j in range(len(val))]),
                       PackedCollator(128)([ds[i] for i in range(40)])["input_ids"])


def test_key_covers_data_tokenizer_and_options(chat_store, tok, tmp_path):
    from hfscale.data.store import store_key

    d, info = chat_store
    data = str(d / "chat.jsonl")
    k = store_key(data, tok.tokenizer, DataOptions(seq_len=128))
    assert k == info.key
    assert store_key(data, tok.tokenizer, DataOptions(seq_len=256)) != k
    assert store_key(data, tok.tokenizer, DataOptions(seq_len=128, train_on="last")) != k
    other = data_tokenizer("tiny-gemma3")
    other.chat_template = other.chat_template.replace("<end_of_turn>", "<eot>")
    assert store_key(data, other, DataOptions(seq_len=128)) != k
    copy = tmp_path / "chat.jsonl"
    copy.write_bytes((d / "chat.jsonl").read_bytes())
    assert store_key(str(copy), tok.tokenizer, DataOptions(seq_len=128)) == k  # content, not path
    copy.write_bytes((d / "chat.jsonl").read_bytes() + b"\n")
    assert store_key(str(copy), tok.tokenizer, DataOptions(seq_len=128)) != k
    with pytest.raises(HfscaleError, match="other data, tokenizer or options"):  # never used silently
        prepare(data, tok.tokenizer, DataOptions(seq_len=64), info.path)
    with pytest.raises(HfscaleError, match="expected"):
        TokenStore(info.path, expect_key="0" * 16)
    assert prepare(data, tok.tokenizer, DataOptions(seq_len=128), info.path).reused


def test_damaged_store_refused(chat_store, tmp_path):
    import shutil

    d, info = chat_store
    bad = tmp_path / "store"
    shutil.copytree(info.path, bad)
    tokens = bad / "train" / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:-2])
    with pytest.raises(HfscaleError, match="damaged: train/tokens.bin has"):
        TokenStore(bad)
    shutil.copytree(info.path, tmp_path / "flip")
    t = tmp_path / "flip" / "train" / "tokens.bin"
    raw = bytearray(t.read_bytes())
    raw[10] ^= 1
    t.write_bytes(bytes(raw))
    with pytest.raises(HfscaleError, match="differs from its manifest's hash"):
        open_info(tmp_path / "flip", full=True)


def test_two_processes_build_the_one_process_store(tmp_path):
    """Rank 0 and 1 of 2 (plain processes, no accelerate) tokenize alternate units; rank 0 merges. The result is
    the store one process makes, file for file."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        write_chat(data / f"part{i}.jsonl", 40, seed=i)
    args = ["-m", "hfscale", "data", "prepare", "--data", str(data), "--model", "tiny-gemma3", "--seq-len", "96"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, *args, "--out", str(tmp_path / "two"), "--rank", str(r), "--world", "2"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    one = subprocess.run([sys.executable, *args, "--out", str(tmp_path / "one")], env=env, capture_output=True, text=True)
    assert one.returncode == 0, one.stderr
    m2, m1 = (json.loads((tmp_path / n / "manifest.json").read_text()) for n in ("two", "one"))
    assert m2["files"] == m1["files"] and m2["key"] == m1["key"] and m2["splits"]["train"]["examples"] > 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "one", "two"]  # no work directory left


def test_kill_during_prepare_leaves_nothing_and_the_next_run_finishes(tmp_path):
    write_chat(tmp_path / "chat.jsonl", 50)
    before = snapshot(tmp_path)
    code = ("import os, signal, sys; from hfscale.data import store; "
            "store.FAULT_HOOKS.append(lambda p, i, r: os.kill(os.getpid(), signal.SIGKILL) if p == 'merge' else None); "
            "from hfscale.data.formats import data_tokenizer; "
            f"store.prepare({str(tmp_path / 'chat.jsonl')!r}, data_tokenizer('tiny-gemma3'), store.DataOptions(64), "
            f"{str(tmp_path / 'store')!r})")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    assert r.returncode == -signal.SIGKILL
    assert not (tmp_path / "store").exists()
    visible = [p for p in os.listdir(tmp_path) if not p.startswith(".")]
    assert visible == ["chat.jsonl"] and snapshot(tmp_path)["chat.jsonl"] == before["chat.jsonl"]
    info = prepare(str(tmp_path / "chat.jsonl"), "tiny-gemma3", DataOptions(64), tmp_path / "store")  # stale stage removed
    assert info.splits["train"].examples > 0
    assert sorted(os.listdir(tmp_path)) == ["chat.jsonl", "store"]


# --- hfscale data: bad input, one line, exit 2, nothing written --------------------------------------


CASES = {
    "malformed.jsonl": ('{"text": "a"}\n{"text": "b"\n', "malformed.jsonl:2: not valid JSON"),
    "mixed.jsonl": ('{"text": "a"}\n{"messages": [{"role": "user", "content": "x"}]}\n', "mixed.jsonl:2 holds messages"),
    "empty.jsonl": ("", "holds no examples"),
    "columns.jsonl": ('{"question": "a"}\n', "columns ['question'] match none of the formats"),
    "noassistant.jsonl": ('{"messages": [{"role": "user", "content": "x"}]}\n', "empty loss mask"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_prepare_refuses_bad_data(name, tmp_path, cli):
    text, needle = CASES[name]
    (tmp_path / name).write_text(text)
    before = snapshot(tmp_path)
    r = cli("data", "prepare", "--data", tmp_path / name, "--model", "tiny-gemma3", "--seq-len", "64",
            "--out", tmp_path / "store", env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("hfscale data: error:")]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert snapshot(tmp_path) == before


def test_messages_with_a_tokenizer_without_template_and_foreign_store(tmp_path, cli):
    from hfscale.models import load_tokenizer

    load_tokenizer("tiny-gemma3").save_pretrained(tmp_path / "tok")  # the built-in tokenizer ships no template
    write_chat(tmp_path / "chat.jsonl", 5)
    env = {"PYTHONPATH": str(ROOT)}
    r = cli("data", "prepare", "--data", tmp_path / "chat.jsonl", "--model", tmp_path / "tok", "--seq-len", "64",
            "--out", tmp_path / "store", env=env)
    assert r.returncode == 2 and "needs a chat template" in r.stderr and not (tmp_path / "store").exists(), r.stderr
    r = cli("data", "info", tmp_path / "tok", env=env)
    assert r.returncode == 2 and "is not a token store" in r.stderr


def test_full_disk_exits_74_with_nothing_half_written(tmp_path, cli):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()})")
    try:
        write_chat(tmp_path / "chat.jsonl", 2000)
        r = cli("data", "prepare", "--data", tmp_path / "chat.jsonl", "--model", "tiny-gemma3", "--seq-len", "64",
                "--out", mnt / "store", env={"PYTHONPATH": str(ROOT)})
        assert r.returncode == 74, r.stderr
        assert "No space left" in r.stderr and "Traceback" not in r.stderr
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# --- users' own Trainer ----------------------------------------------------------------------------


@pytest.mark.slow  # ~10 s of CPU: the Trainer's set-up dominates 2 steps of the tiny model
def test_transformers_trainer_trains_from_the_store(chat_store, tmp_path):
    """HF Trainer takes the store's Dataset and collator as they are (model(**batch)); 2 steps move the loss.
    respect_documents_ first: without it transformers builds no per-document mask in train mode (a cache is made)."""
    from transformers import Trainer, TrainingArguments

    from hfscale.models import build_model
    from hfscale.models.documents import respect_documents_

    d, info = chat_store
    ds = PackedDataset(info.path)
    args = TrainingArguments(str(tmp_path / "t"), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                             report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, dataloader_num_workers=0)
    model = build_model("tiny-gemma3")
    respect_documents_(model)
    trainer = Trainer(model, args, train_dataset=ds, data_collator=PackedCollator(ds.seq_len))
    out = trainer.train()
    assert out.global_step == 2 and np.isfinite(out.training_loss)


@pytest.mark.slow  # as above
def test_trl_sfttrainer_trains_from_the_store(chat_store, tmp_path):
    """TRL's SFTTrainer takes the store's rows as a prepared `datasets.IterableDataset` (its own tokenizing and packing
    skipped: the store did both, with masks and boundaries) and the collator as data_collator."""
    pytest.importorskip("trl")
    from trl import SFTConfig, SFTTrainer

    from hfscale.models import build_model
    from hfscale.models.documents import respect_documents_

    d, info = chat_store
    ds = PackedDataset(info.path)
    args = SFTConfig(str(tmp_path / "s"), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3, report_to=[],
                     save_strategy="no", logging_steps=1, use_cpu=True, dataloader_num_workers=0,
                     dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False)
    model = build_model("tiny-gemma3")
    respect_documents_(model)  # packed rows: documents kept apart in the Trainer's model(**batch)
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds.as_iterable(seed=0),
                         data_collator=PackedCollator(ds.seq_len), processing_class=data_tokenizer("tiny-gemma3"))
    out = trainer.train()
    assert out.global_step == 2 and np.isfinite(out.training_loss)


def test_mixture_weights_repeat_and_subsample_sources(tmp_path, tok):
    """'a:2,b:0.5': every document of a twice per pass, a fixed half of b's; held out by content, not by weight."""
    for name, n in (("a", 40), ("b", 40)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"text": f"{name} document {i} about lists and tuples."}) + "\n")
    info = prepare(f"{tmp_path / 'a.jsonl'}:2,{tmp_path / 'b.jsonl'}:0.5", tok.tokenizer,
                   DataOptions(seq_len=64, packing="bfd", heldout=0.0), tmp_path / "store")
    st = TokenStore(info.path)
    seen = np.asarray(st.segments)[:, 0]
    docs_a = info.splits["train"].documents // 2  # a's 40 documents come first (unit order), then b's 40
    assert docs_a == 40
    counts = np.bincount(seen, minlength=80)
    assert (counts[:40] == 2).all() and set(counts[40:].tolist()) <= {0, 1} and 12 <= counts[40:].sum() <= 28


def test_units_split_a_file_on_line_boundaries_and_name_the_line(tmp_path, monkeypatch):
    """A jsonl file cut into byte ranges: every line read exactly once, whatever the cut; an error in a later unit
    still names its file:line."""
    from hfscale.data import sources

    lines = [json.dumps({"text": f"line {i} " + "x" * (i % 37)}) for i in range(500)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(sources, "UNIT_BYTES", 1000)
    units = sources.units_of(sources.parse_sources(str(tmp_path / "d.jsonl")))
    assert len(units) > 10
    got = [r["text"] for u in units for _, r in sources.records(u)]
    assert got == [json.loads(x)["text"] for x in lines]
    lines[321] = '{"text": broken'
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(HfscaleError, match=r"d.jsonl:322: not valid JSON"):
        for u in sources.units_of(sources.parse_sources(str(tmp_path / "d.jsonl"))):
            list(sources.records(u))


def test_a_mixture_carries_sources_of_different_formats(tmp_path, tok):
    """'text.jsonl,pc.jsonl': each source detected and masked by its own format (text: every token; plain
    prompt/completion: the completion only), one bfd packing over both, per-source counts in the manifest; two
    formats inside one source are still refused."""
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": f"document {i} about lists."}) + "\n" for i in range(8)))
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps({"prompt": f"Question {i}: what is a list?",
                                                           "completion": " A mutable sequence."}) + "\n" for i in range(8)))
    info = prepare(f"{tmp_path / 'text.jsonl'},{tmp_path / 'pc.jsonl'}", tok.tokenizer,
                   DataOptions(seq_len=64, heldout=0.0), tmp_path / "store")
    assert (info.options["format"], info.options["packing"]) == ("mixed", "bfd")
    text, pc = info.sources
    assert (text.format, text.train_on, pc.format, pc.train_on) == ("text", "all", "prompt_completion", "completion")
    assert text.documents == (0, 8) and pc.documents == (8, 16) and text.examples == pc.examples == 8
    st = TokenStore(info.path)
    completion = len(tok.tokenizer(" A mutable sequence.", add_special_tokens=False)["input_ids"]) + 1  # + EOS
    assert text.trained == text.tokens - 8  # every token but each document's first
    assert pc.trained == 8 * completion < pc.tokens - 8  # the prompts untrained
    assert text.trained + pc.trained == info.splits["train"].trained == int(np.asarray(st.row_trained).sum())
    assert "source 1" in "\n".join(info.lines()) and "prompt_completion, train_on completion" in "\n".join(info.lines())
    with open(tmp_path / "pc.jsonl", "a") as f:
        f.write(json.dumps({"text": "a text record in the prompt/completion file"}) + "\n")
    with pytest.raises(HfscaleError, match="pc.jsonl:9 holds text data but .*pc.jsonl:1 holds prompt_completion"):
        prepare(f"{tmp_path / 'text.jsonl'},{tmp_path / 'pc.jsonl'}", tok.tokenizer, DataOptions(seq_len=64, heldout=0.0),
                tmp_path / "store2")
