"""Outputs as issue 16 asks: no command writes over, into or around one of its inputs (--force or
not); paths that cannot hold an output are one line and exit 2 with nothing written; every writer
stages beside its target, so a real kill -9 at any point leaves no half-written target, and the next
run that writes there removes the stale stage; final modes follow the umask.

Kills run the writer in a subprocess (tests/scripts/writers.py) that replaces one function by a
SIGKILL of itself, so production code reads no environment for it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hfscale.util.atomic import STAGE_PREFIX, _start_ticks, check_writable, clean_stale, stage_name, staged
from conftest import snapshot
from hfscale.util.errors import HfscaleError

WRITERS = Path(__file__).parent / "scripts" / "writers.py"
PLAN = ["plan", "--model", "tiny-gemma3", "--seq-len", "128", "--micro-batch", "1", "--gpus-per-node", "1",
        "--gpu-mem", "8GB"]


def stages(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(f"{STAGE_PREFIX}*"))


def du(p: Path) -> int:
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def writers(*steps, kill_at=None, umask=0o022, cwd=None):
    argv = [sys.executable, str(WRITERS)] + (["--kill-at", kill_at] if kill_at else [])
    for i, s in enumerate(steps):
        argv += (["+"] if i else []) + [str(a) for a in s]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, umask=umask, cwd=cwd,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def one_line_exit_2(capsys, *args) -> str:
    from hfscale.cli import main

    rc = main([str(a) for a in args])
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err)
    return lines[0]


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    """`hfscale tiny` (random init, 12 MB): a quantize source that takes seconds to make."""
    d = tmp_path_factory.mktemp("src") / "tiny"
    r = writers(["cli", "tiny", "--out", d])
    assert r.returncode == 0, r.stderr
    return d


@pytest.fixture
def src(tiny_src, tmp_path):
    """A private copy of the tiny model dir under tmp_path/work, with a symlink to it beside it."""
    import shutil

    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(tiny_src, work / "model")
    (work / "link").symlink_to(work / "model")
    return work / "model"


# --- inputs are sacred --------------------------------------------------------------------------


def test_guard_same_inside_containing_symlink_and_cwd(tmp_path, monkeypatch):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "ln").symlink_to(model)
    cases = {
        model: "is the input",                          # same
        model / "q": "is inside the input",             # inside
        tmp_path: "contains the input",                 # containing
        tmp_path / "ln": "is the input",                # a symlink to the input
        tmp_path / "ln" / "q": "is inside the input",   # under a symlink to the input
    }
    for out, needle in cases.items():
        for force in (False, True):
            with pytest.raises(HfscaleError, match=needle) as e:
                check_writable({out: "--out"}, force, inputs={model: "MODEL"})
            assert "--out" in str(e.value) and "choose another --out" in str(e.value)
    with pytest.raises(HfscaleError, match="real paths"):
        check_writable({tmp_path / "ln": "--out"}, True, inputs={model: "MODEL"})
    check_writable({tmp_path / "other": "--out"}, False, inputs={model: "MODEL", "tiny-gemma3": "MODEL"})
    monkeypatch.chdir(model)
    for out in (".", "..", str(tmp_path)):
        with pytest.raises(HfscaleError, match="current directory"):
            check_writable({out: "--out"}, True)


@pytest.mark.parametrize("fmt, out", [
    ("transformers", "{model}"), ("transformers", "{model}/q"), ("transformers", "{work}"),
    ("transformers", "{link}"), ("transformers", "{link}/q"),
    ("gguf", "{model}/m.gguf"), ("gguf", "{link}/m.gguf"), ("pte", "{model}/m.pte"), ("gguf", "{work}"),
])
def test_quantize_never_writes_its_input(src, fmt, out, capsys):
    work = src.parent
    out = out.format(model=src, work=work, link=work / "link")
    before = snapshot(work)
    extra = ["--scheme", "8da4w"] if fmt == "transformers" else ["--format", fmt]
    for force in ([], ["--force"]):
        line = one_line_exit_2(capsys, "quantize", src, *extra, "--out", out, *force)
        assert "the input MODEL" in line and "--force or not" in line
        assert snapshot(work) == before  # the source byte-identical, nothing new beside it


def test_quantize_from_a_symlink_refuses_the_real_dir(src, capsys):
    line = one_line_exit_2(capsys, "quantize", src.parent / "link", "--scheme", "8da4w", "--out", src, "--force")
    assert "is the input MODEL" in line and f"real paths {src}" in line


def test_config_plan_prove_tiny_guard(src, tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "mine.yaml").write_text("name: mine\nzero:\n  stage: 2\n")
    (tmp_path / "spec_link.yaml").symlink_to(cfg / "mine.yaml")
    (tmp_path / "p" / "ranks").mkdir(parents=True)
    (tmp_path / "p" / "ranks" / "a.yaml").write_text("compute_environment: LOCAL_MACHINE\n")
    before = snapshot(tmp_path)
    # config: the YAML it would write is the --spec it reads (directly, or through a symlink)
    for spec in (cfg / "mine.yaml", tmp_path / "spec_link.yaml"):
        line = one_line_exit_2(capsys, "config", "--spec", spec, "--out-accelerate", cfg, "--out-deepspeed", tmp_path / "ds", "--force")
        assert "is the input --spec" in line and line.endswith("choose another --out-accelerate")
    # plan: --write / --plot into, or around, the model directory given as --model
    for flag, where in [("--write", src), ("--write", src / "sub"), ("--plot", src / "p.png"), ("--write", src.parent)]:
        line = one_line_exit_2(capsys, *PLAN[:2], src, *PLAN[3:], flag, where, "--force")
        assert line.startswith(f"hfscale plan: error: {flag} ") and "the input --model" in line
    # prove: --out whose ranks/ it replaces holds the --config
    line = one_line_exit_2(capsys, "prove", "--config", tmp_path / "p" / "ranks" / "a.yaml", "--out", tmp_path / "p")
    assert "ranks contains the input --config" in line
    # tiny reads no input, but never replaces the directory it runs in (it used to empty it with --force)
    monkeypatch.chdir(cfg)
    for out in (".", "..", tmp_path):
        assert "current directory" in one_line_exit_2(capsys, "tiny", "--out", out, "--force")
    assert snapshot(tmp_path) == before


def test_training_output_dir_never_holds_its_model(src, root):
    """train_clm's pre-flight: --output-dir whose model/ (or checkpoints/) would replace the --model."""
    run = src.parent  # work/model is the consolidated save of a run in work/
    before = snapshot(run)
    for out in (run, src):
        r = subprocess.run([sys.executable, str(root / "recipes" / "train_clm.py"), "--config", str(root / "recipes/tiny/train.yaml"),
                            "--model", str(src), "--output-dir", str(out), "--force"],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "--output-dir" in r.stderr and "the input --model" in r.stderr
    assert snapshot(run) == before


# --- paths that cannot hold an output -----------------------------------------------------------


def test_unusable_parents_are_one_line_and_write_nothing(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    before = snapshot(tmp_path)
    for args, flag in [
        (["tiny", "--out", tmp_path / "f" / "t"], "--out"),
        (["tiny", "--out", tmp_path / "f" / "deeper" / "t"], "--out"),
        ([*PLAN, "--plot", tmp_path / "f" / "p.png"], "--plot"),
        ([*PLAN, "--write", tmp_path / "f" / "w"], "--write"),
        (["config", "zero2", "--out-accelerate", tmp_path / "f", "--out-deepspeed", tmp_path], "--out-accelerate"),
        (["config", "zero2", "--out-accelerate", tmp_path, "--out-deepspeed", tmp_path / "f"], "--out-deepspeed"),
    ]:
        line = one_line_exit_2(capsys, *args)
        assert f"{flag} " in line and "is a file, not a directory" in line
    # not writable: we run as root, so permission bits do not stop us; /proc refuses new entries even to root
    for args, flag in [(["tiny", "--out", "/proc/hfscale_t"], "--out"), ([*PLAN, "--plot", "/proc/x/p.png"], "--plot"),
                       (["config", "zero2", "--out-accelerate", "/proc/c"], "--out-accelerate")]:
        line = one_line_exit_2(capsys, *args)
        assert f"{flag} " in line and "cannot create files in /proc" in line
    assert snapshot(tmp_path) == before


def test_missing_parents_are_created(tmp_path, capsys):
    from hfscale.cli import main

    assert main([*PLAN, "--plot", str(tmp_path / "new" / "dir" / "p.png")]) == 0
    assert (tmp_path / "new" / "dir" / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "new" / "dir").iterdir()) == ["p.png"]


# --- the staging helper -------------------------------------------------------------------------


def test_staged_file_and_dir_commit_or_vanish(tmp_path):
    t = tmp_path / "a.json"
    t.write_text("old")
    with pytest.raises(RuntimeError):
        with staged(t) as s:
            s.write_text("half")
            raise RuntimeError("boom")
    assert t.read_text() == "old" and os.listdir(tmp_path) == ["a.json"]
    d = tmp_path / "d"
    d.mkdir()
    (d / "old").write_text("1")
    with staged(d, directory=True) as s:
        assert s.parent == tmp_path and s.name == stage_name("d") and s.is_dir()
        (s / "new").write_text("2")
    assert [p.name for p in d.iterdir()] == ["new"] and sorted(os.listdir(tmp_path)) == ["a.json", "d"]


def test_stale_stages_removed_live_and_foreign_kept(tmp_path):
    host = stage_name("x").split(".")[2]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me, start = os.getpid(), _start_ticks(os.getpid())
    names = {
        f"{STAGE_PREFIX}{host}.{dead.pid}.{start}.a.gguf": False,       # writer gone
        f"{STAGE_PREFIX}{host}.{me}.{start + 1}.b": False,              # pid reused by a later process
        f"{STAGE_PREFIX}{host}.{me}.{start}.c": True,                   # a live writer (this process)
        f"{STAGE_PREFIX}otherhost.{dead.pid}.{start}.d": True,          # another host's: cannot know
        ".a.gguf.tmp": True,                                            # not ours
    }
    for n in names:
        (tmp_path / n).mkdir() if n.endswith(".b") else (tmp_path / n).write_bytes(b"x" * 1000)
    gone = clean_stale(tmp_path)
    assert sorted(p.name for p in gone) == sorted(n for n, keep in names.items() if not keep)
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, keep in names.items() if keep)


# --- permissions --------------------------------------------------------------------------------


def modes(root: Path) -> dict[str, set]:
    got = {"dir": set(), "file": set()}
    for p in root.rglob("*"):
        if not p.is_symlink():
            got["dir" if p.is_dir() else "file"].add(stat.S_IMODE(p.stat().st_mode))
    return got


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_every_writer_gets_the_umask_modes(tmp_path, umask):
    o = tmp_path / "o"
    r = writers(["cli", "tiny", "--out", o / "tiny"],
                ["cli", "quantize", o / "tiny", "--scheme", "8da4w", "--out", o / "q"],
                ["cli", "quantize", o / "tiny", "--format", "gguf", "--qtype", "Q8_0", "--no-verify", "--out", o / "g" / "m.gguf"],
                ["cli", "config", "zero2", "--out-accelerate", o / "c", "--out-deepspeed", o / "c"],
                ["cli", *PLAN, "--write", o / "plan", "--plot", o / "plot" / "p.png"],
                ["ckpt", o / "run", 2], ["final", o / "run" / "model"], umask=umask)
    assert r.returncode == 0, r.stderr[-3000:]
    names = {p.relative_to(o).as_posix() for p in o.rglob("*")}
    for want in ["tiny/model.safetensors", "q/model.safetensors", "g/m.gguf", "g/m.gguf.json", "c/zero2.json",
                 "c/zero2.yaml", "plan/training_args.yaml", "plot/p.png", "run/checkpoints/step_00000002/hfscale_state.json",
                 "run/model/model.safetensors"]:
        assert want in names, sorted(names)
    assert modes(o) == {"dir": {0o777 & ~umask}, "file": {0o666 & ~umask}}, modes(o)
    assert stages(o) == []


# --- kill -9 at several points of each write ----------------------------------------------------


def killed(*steps, at, umask=0o022):
    r = writers(*steps, kill_at=at, umask=umask)
    assert r.returncode == -9, (at, r.returncode, r.stderr[-3000:])


def test_kill_config_write(tmp_path):
    c = tmp_path / "c"
    cmd = ["cli", "config", "zero2", "--out-accelerate", c, "--out-deepspeed", c]
    killed(cmd, at="os:fsync")  # the JSON's stage written, not yet flushed or renamed
    (half,) = c.iterdir()
    assert half.name.startswith(STAGE_PREFIX) and half.name.endswith(".zero2.json")
    killed(cmd + ["--force"], at="hfscale.util.atomic:commit:2")  # JSON renamed in, the YAML staged whole
    assert json.loads((c / "zero2.json").read_text())["zero_optimization"]["stage"] == 2
    assert not (c / "zero2.yaml").exists() and not half.exists()  # this run removed the first one's stage
    (yml,) = stages(tmp_path)
    assert yml.name.endswith(".zero2.yaml") and "zero2.json" in yml.read_text()
    r = writers(cmd + ["--force"])  # the next run writing there
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in c.iterdir()) == ["zero2.json", "zero2.yaml"]


def test_kill_quantize_dir(src, tmp_path):
    q = tmp_path / "q"
    cmd = ["cli", "quantize", src, "--scheme", "8da4w", "--out", q]
    killed(cmd, at="transformers.tokenization_utils_base:PreTrainedTokenizerBase.save_pretrained")  # weights, no tokenizer
    (mid,) = stages(tmp_path)
    assert not q.exists() and du(mid / "model.safetensors") > 5_000_000 and not (mid / "tokenizer.json").exists()
    assert writers(cmd).returncode == 0
    assert stages(tmp_path) == []  # the next run removed the stale stage (megabytes)
    old = snapshot(q)
    regroup = cmd + ["--force", "--group-size", "64"]
    killed(regroup, at="hfscale.util.atomic:_exchange")  # the new dir complete, about to be swapped in
    assert snapshot(q) == old and len(stages(tmp_path)) == 1
    killed(regroup, at="hfscale.util.atomic:_exchange:after")  # swapped in, the old one not yet removed
    assert json.loads((q / "hfscale_quantization.json").read_text())["group_size"] == 64 and (q / "tokenizer.json").is_file()
    (aside,) = stages(tmp_path)  # the old dir under a stage name; the previous kill's stage is gone
    assert json.loads((aside / "hfscale_quantization.json").read_text())["group_size"] == 32
    assert writers(cmd + ["--force"]).returncode == 0
    assert stages(tmp_path) == [] and sorted(os.listdir(tmp_path)) == ["q", "work"]


def test_kill_gguf(src, tmp_path):
    g = tmp_path / "m.gguf"
    cmd = ["cli", "quantize", src, "--format", "gguf", "--qtype", "Q8_0", "--out", g]
    killed(cmd, at="gguf.gguf_writer:GGUFWriter.write_tensors_to_file")  # header written, no tensors
    (half,) = stages(tmp_path)
    assert half.name.endswith(".m.gguf") and half.stat().st_size < 1_000_000
    killed(cmd, at="hfscale.export.verify_llama:verify_gguf")  # written whole, not verified yet
    (whole,) = stages(tmp_path)
    assert not g.exists() and not half.exists() and whole.stat().st_size > 3_000_000
    r = writers(cmd + ["--no-verify"], umask=0o077)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["m.gguf", "m.gguf.json", "work"]
    assert json.loads((tmp_path / "m.gguf.json").read_text())["bytes"] == g.stat().st_size
    assert stat.S_IMODE(g.stat().st_mode) == stat.S_IMODE((tmp_path / "m.gguf.json").stat().st_mode) == 0o600


def test_kill_pte(tmp_path):
    from hfscale.testing.pruned import one_layer_tiny

    src = one_layer_tiny(tmp_path / "work" / "model")  # lowers in a quarter of the 4-layer model's time
    p = tmp_path / "m.pte"
    cmd = ["cli", "quantize", src, "--format", "pte", "--qtype", "fp32", "--no-verify", "--max-seq-len", "32", "--out", p]
    killed(cmd, at="hfscale.export.pte:lower_to_pte:after")  # the program written whole, not renamed
    (left,) = stages(tmp_path)
    assert not p.exists() and left.stat().st_size > 1_000_000  # 1-layer fp32: the 3.1 MB embedding alone
    r = writers(cmd, umask=0o077)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["m.pte", "m.pte.json", "work"] and stat.S_IMODE(p.stat().st_mode) == 0o600


def test_kill_checkpoint_and_consolidated_save(tmp_path):
    from hfscale.train.state import MARKER, Checkpoints

    run = tmp_path / "run"
    ck = run / "checkpoints"
    killed(["ckpt", run, 2], ["ckpt", run, 4], at="accelerate:Accelerator.save_state:2:after")  # state, no marker
    (s4,) = stages(ck)
    assert s4.name.endswith(".step_00000004") and not (s4 / MARKER).exists() and du(s4) > 10_000_000
    killed(["ckpt", run, 6], at="hfscale.util.atomic:commit:2")  # marker in, the directory not yet renamed
    (s6,) = stages(ck)  # the step-4 stage was removed by this run
    assert json.loads((s6 / MARKER).read_text())["step"] == 6
    assert [s for s, _ in Checkpoints(run, 2).complete()] == [2]  # a stage is never resumed from
    killed(["final", run / "model"], at="hfscale.util.atomic:commit")
    assert not (run / "model").exists() and len(stages(run)) == 2
    r = writers(["ckpt", run, 4], ["final", run / "model"])  # the next run saving there
    assert r.returncode == 0, r.stderr
    assert stages(run) == [] and [s for s, _ in Checkpoints(run, 2).complete()] == [2, 4]
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000002", "step_00000004"]
    assert (run / "model" / "model.safetensors").stat().st_size > 10_000_000
