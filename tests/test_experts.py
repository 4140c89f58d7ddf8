"""Experts from storage (hfscale/experts): logits equal the fully loaded model's bit for bit, the cache
stays within its budget and counts exactly, expert tensors are never read whole, failed reads (truncated,
missing, corrupt files) and reads slower than read_timeout_s are one clear error that leaves the cache
consistent and the model usable once the file is good, and the CLI refuses bad input in one line."""

import json
import os

import pytest
import torch

from hfscale.util.errors import HfscaleError
from hfscale.experts import ExpertCache, from_pretrained, offload_
from hfscale.testing.aligned import load_owned
from hfscale.testing.tiny_moe import build_tiny_moe, tiny_moe_config

from conftest import run_cli, run_cli_concurrently

# 16 experts x (gate_up 128x128 + down 128x64) fp32 = 16 x 98,304 B per layer, top-4
EXPERT_BYTES = (2 * 64 * 128 + 128 * 64) * 4


@pytest.fixture(scope="module")
def g4(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("g4moe") / "m")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from transformers import AutoModelForCausalLM, MixtralConfig

    from hfscale.models import TINY, load_tokenizer

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    out = tmp_path_factory.mktemp("mixtral") / "m"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)  # transformers 5.24 saves experts.{e}.w1/w2/w3
    load_tokenizer(TINY).save_pretrained(out)
    return str(out)


def _reference(path, reader="pread"):
    """The fully loaded model, its expert weights at the alignment the offloaded ones have, so both run the same
    kernels on every host (hfscale/testing/aligned.py: MKL's gemv on AMD hosts rounds a one-token decode
    differently by alignment): the pread reader fills fresh buffers, so the reference owns its weights; the mmap
    reader uses the file in place, at the offsets transformers' own mapped weights have."""
    from transformers import AutoModelForCausalLM

    if reader == "mmap":
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load_owned(path, dtype=torch.float32)


IDS = torch.randint(3, 4096, (2, 80), generator=torch.Generator().manual_seed(0))  # 80 > the 64-token window


@pytest.mark.parametrize("which, reader, prefetch", [("g4", "pread", False), ("g4", "mmap", True),
                                                     ("mixtral", "pread", True)])
def test_logits_bit_identical_under_a_tight_budget(which, reader, prefetch, request):
    path = request.getfixturevalue(which)
    ref = _reference(path, reader)
    with torch.no_grad():
        grouped = ref(IDS).logits  # transformers' default experts implementation
        ref.set_experts_implementation("eager")
        want = ref(IDS).logits
    k = ref.config.get_text_config().top_k_experts if which == "g4" else ref.config.num_experts_per_tok
    off_model = from_pretrained(path, ram_budget=k * 2 * _expert_bytes(ref), reader=reader, prefetch=prefetch)
    off = off_model.hfscale_experts
    with torch.no_grad():
        got = off_model(IDS).logits
        got_decode = off_model(IDS[:, :1]).logits
    assert torch.equal(got, want)  # bit-identical to transformers' eager expert loop, fp32
    # grouped_mm sums the top-k outputs in another order: fp32 rounding only (measured 1.9e-5 on g4)
    assert (got - grouped).abs().max() < 1e-4
    with torch.no_grad():
        assert torch.equal(got_decode, ref(IDS[:, :1]).logits)
    off.cache.drain()
    s = off.stats()
    assert s["bytes_read"] == s["reads"] * s["expert_bytes"]  # whole experts, counted exactly
    assert s["peak_bytes"] <= s["budget_bytes"] and s["evictions"] > 0
    assert s["hits"] + s["misses"] > 0 and s["failed_reads"] == 0
    off.cache.check()
    # nothing of the experts is a parameter: resident = every parameter but the routed experts
    names = [n for n, _ in off_model.named_parameters()]
    assert not any(n.endswith(("gate_up_proj", "down_proj")) and "experts" in n for n in names)
    full = sum(p.numel() for p in ref.parameters())
    resident = sum(p.numel() for p in off_model.parameters())
    assert full - resident == s["streamed_bytes"] // 4
    off.close()


def _expert_bytes(model) -> int:
    from hfscale.experts import find_experts

    _, mod = find_experts(model)[0]
    return (mod.gate_up_proj[0].numel() + mod.down_proj[0].numel()) * mod.gate_up_proj.element_size()


def test_expert_tensors_never_read_whole(g4, monkeypatch):
    """Loading reads every other tensor with safe_open.get_tensor; an expert tensor never."""
    import safetensors

    whole = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self._f = real(*a, **k)

        def __enter__(self):
            self._f.__enter__()
            return self

        def __exit__(self, *a):
            return self._f.__exit__(*a)

        def get_tensor(self, key):
            whole.append(key)
            return self._f.get_tensor(key)

        def __getattr__(self, name):
            return getattr(self._f, name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    m = from_pretrained(g4, ram_budget="10MB")
    assert whole and not [k for k in whole if ".experts." in k]
    assert m.hfscale_experts.stats()["reads"] == 0  # nothing read before a forward
    assert EXPERT_BYTES == m.hfscale_experts.expert_bytes
    m.hfscale_experts.close()


def test_lru_order_and_exact_counts():
    loads = []

    def load(key):
        loads.append(key)
        return (torch.zeros(25), torch.zeros(0))  # 100 bytes

    c = ExpertCache(load, lambda key: 100, budget=300)
    for key in [1, 2, 3, 1, 4, 2, 1, 5]:  # 4 evicts 2 (1 was used again), 2 evicts 3, 5 evicts 4
        c.get(key)
    assert loads == [1, 2, 3, 4, 2, 5]
    assert (c.stats.hits, c.stats.misses, c.stats.evictions) == (2, 6, 3)
    assert c.cached_keys() == [2, 1, 5] and c.cached_bytes == 300 and c.stats.peak_bytes == 300
    c.prefetch([7, 1])  # 1 is cached: only 7 is read ahead (evicting 2)
    c.drain()
    c.get(7)
    assert (c.stats.prefetched, c.stats.prefetch_hits) == (1, 1) and c.cached_keys() == [1, 5, 7]
    c.check()
    c.close()


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _replace(path, data: bytes) -> None:
    """Put `data` at `path` as a new file (a new inode, as a re-download or re-save does)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _broken_then_repaired(m, weights, data, match, break_it):
    """Break the weights, check one clear error and consistent cache, repair, check the same logits."""
    off = m.hfscale_experts
    with torch.no_grad():
        want = m(IDS[:1, :8]).logits
    assert off.cache.cached_keys()  # in use before the failure
    off.cache.clear()
    break_it()
    with pytest.raises(HfscaleError, match=match) as e:  # noqa: PT012
        with torch.no_grad():
            m(IDS[:1, :8])
    assert "\n" not in str(e.value)
    off.cache.drain()
    off.cache.check()  # bytes, reservations and budget: nothing half-inserted
    s = off.stats()
    assert s["failed_reads"] >= 1 and s["bytes_read"] == s["reads"] * s["expert_bytes"]
    _replace(weights, data)  # repaired: the same model goes on, same logits
    with torch.no_grad():
        assert torch.equal(m(IDS[:1, :8]).logits, want)
    off.cache.check()
    return s


@pytest.mark.parametrize("reader", ["pread", "mmap"])
def test_truncated_shard_is_one_clear_error_and_cache_stays_consistent(g4, tmp_path, reader):
    path = _copy(g4, tmp_path / "m")
    m = from_pretrained(path, ram_budget=4 * EXPERT_BYTES, prefetch=True, reader=reader)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    match = {"pread": "reading expert weights from .*model.safetensors failed .*short read",
             "mmap": "reading expert weights from .*model.safetensors failed .*truncated file"}[reader]
    # truncated in place under the running model (the open descriptor sees it); repaired as a new file,
    # which the reader opens by path after the failure
    _broken_then_repaired(m, weights, data, match, lambda: weights.write_bytes(data[: len(data) // 2]))
    m.hfscale_experts.close()


def test_missing_or_unreadable_shard_is_one_clear_error(g4, tmp_path):
    path = _copy(g4, tmp_path / "m")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    m = from_pretrained(path, ram_budget=4 * EXPERT_BYTES)
    reader = m.hfscale_experts.reader

    def gone():  # removed while not open (as a shard not read yet is): the next read must open it by path
        reader.close()
        weights.unlink()

    _broken_then_repaired(m, weights, data, "cannot open expert weights .*model.safetensors .*No such file.*put the "
                          "file back or load the model again", gone)
    if os.geteuid() != 0:  # root reads a mode-000 file: a permission error cannot be made for it

        def unreadable():
            reader.close()
            weights.chmod(0)

        _broken_then_repaired(m, weights, data, "cannot open expert weights .*Permission denied", unreadable)
    m.hfscale_experts.close()
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")  # corrupt header
    with pytest.raises(HfscaleError, match="cannot read the safetensors header of .*re-save the model"):
        from_pretrained(path, ram_budget=4 * EXPERT_BYTES)


def test_slow_read_times_out_cleanly_and_the_read_is_kept(g4):
    """A storage that takes 0.5 s per read (a real read after a sleep) against read_timeout_s=0.1."""
    import threading
    import time

    from hfscale.experts.store import Reader

    gate = threading.Event()

    class SlowStorage(Reader):
        def read(self, *a, **k):
            if not gate.is_set():
                time.sleep(0.5)
            return super().read(*a, **k)

    m = from_pretrained(g4, ram_budget=8 * EXPERT_BYTES, read_timeout_s=0.1)
    off = m.hfscale_experts
    off.reader = SlowStorage("pread")
    with pytest.raises(HfscaleError, match=r"reading expert \d+ of layer 0 from .*model.safetensors took longer than "
                       r"read_timeout_s=0.1 s; .*raise read_timeout_s \(--read-timeout\)"):
        with torch.no_grad():
            m(IDS[:1, :1])
    assert off.stats()["timeouts"] == 1
    gate.set()
    off.cache.drain(forever=True)  # the slow reads complete and are cached whole
    off.cache.check()
    s = off.stats()
    assert s["reads"] >= 1 and s["failed_reads"] == 0 and s["bytes_read"] == s["reads"] * EXPERT_BYTES
    ref = _reference(g4)
    ref.set_experts_implementation("eager")
    with torch.no_grad():
        assert torch.equal(m(IDS[:1, :1]).logits, ref(IDS[:1, :1]).logits)
    with pytest.raises(HfscaleError, match="read_timeout_s must be a positive number"):
        from_pretrained(g4, ram_budget=8 * EXPERT_BYTES, read_timeout_s=0)
    off.close()


def test_offload_in_memory_model_frees_experts_and_matches(g4):
    ref = _reference(g4)
    ref.set_experts_implementation("eager")
    model = _reference(g4)
    with torch.no_grad():
        want = ref(IDS).logits
    offload_(model, ram_budget="1MB")
    off = model.hfscale_experts
    folder = next(iter(off.sources.values())).tensors
    folder = next(iter(folder.values())).file.parent
    assert len(list(folder.glob("experts-*.safetensors"))) == 6
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, want)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters()) - 6 * 16 * EXPERT_BYTES // 4
    off.close()
    assert not folder.exists()  # the temporary copy goes with close()
    with pytest.raises(HfscaleError, match="offloaded already"):
        offload_(model, ram_budget="1MB")


def test_cli_scores_and_generates(g4, tmp_path):
    score, r = run_cli_concurrently(  # two independent real runs at once, one per core
        ("experts", g4, "--ram-budget", "1MB", "--blocks", "2", "--seq-len", "32", "--json"),
        ("experts", g4, "--ram-budget", "1MB", "--prompt", "The history of", "--max-new-tokens", "4", "--prefetch"),
        cwd=tmp_path)
    assert score.returncode == 0, score.stderr
    out = json.loads(score.stdout)
    assert out["tokens"] == 64 and out["perplexity"] > 1
    assert out["cache"]["peak_bytes"] <= 10**6 and out["cache"]["cache_experts"] == 10**6 // EXPERT_BYTES
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stdout and "read-ahead used" in r.stdout
    assert os.listdir(tmp_path) == []  # nothing written


def test_cli_bad_input_one_line(g4, tmp_path):
    from hfscale.models import save_pretrained_dir

    dense = save_pretrained_dir("tiny-gemma3", tmp_path / "dense")
    cases = [((dense, "--ram-budget", "1GB"), "no mixture-of-experts layers"),
             ((g4, "--ram-budget", "300kB"), "cannot read size"),
             ((g4, "--ram-budget", "300KB".replace("KB", "000B")), "smaller than one layer's routed experts"),
             ((tmp_path / "nope", "--ram-budget", "1GB"), "not found"),
             ((g4, "--ram-budget", "1MB", "--read-timeout", "0"), "--read-timeout must be a positive number")]
    runs = run_cli_concurrently(*[("experts", *args, "--prompt", "x") for args, _ in cases], cwd=tmp_path)
    for (args, message), r in zip(cases, runs, strict=True):  # five real CLI runs at once: the imports overlap
        assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
        assert "Traceback" not in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["dense"]


def test_budget_below_top_k_experts_is_refused_before_loading(g4):
    with pytest.raises(HfscaleError, match=r"top-4 x 98,304 bytes = 393,216\); give at least --ram-budget 0.4MB"):
        from_pretrained(g4, ram_budget=4 * EXPERT_BYTES - 1)
    assert tiny_moe_config().top_k_experts == 4
