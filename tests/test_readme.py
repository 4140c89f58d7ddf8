"""Issue 30: the README a newcomer reads. Its relative links resolve (README and docs/), its first screen
says what / install / first command, and its quick-start block runs top to bottom as written."""

import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages():
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def quick_start() -> str:
    """The first ```bash block after the '## Quick start' heading."""
    text = README.read_text()
    section = text.split("## Quick start", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_relative_links_resolve():
    checked = 0
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+://|mailto:|#", target):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)}: broken link {target}"
            checked += 1
    assert checked >= 10  # the capability table links every docs page


# a repository path: a top-level folder of the checkout, then anything up to whitespace or a quote / bracket
REPO_TOPS = ("recipes", "hfscale", "tests", "tools", "benchmarks", "docs", "accelerate_configs", "ds_configs")
REPO_PATH = re.compile(r"(?<![\w./-])((?:%s)/[^\s`'\"()\[\]]*)" % "|".join(REPO_TOPS))
CODE_SPAN = re.compile(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", re.S)  # fenced blocks and inline spans
# not a file that must exist: globs and placeholders (`benchmarks/results/prune_speed*.md`, `recipes/<family>/`)
PATTERN_CHARS = set("*?<>{}$")


def repo_paths(text: str) -> list[str]:
    """The repository paths a page names in code (fenced blocks and spans) and link targets. Run outputs (`runs/...`, OUTPUT_DIR,
    `demo_out/...`) do not start with a checkout folder, so they are not collected; a link written relative to
    its page (`../recipes/x.py`) is test_relative_links_resolve's, and the lookbehind skips it."""
    out = []
    for span in [a or b for a, b in CODE_SPAN.findall(text)] + LINK.findall(text):
        for m in REPO_PATH.finditer(span):
            path = m.group(1).split("#")[0].split(":")[0].rstrip(".,;")
            if not PATTERN_CHARS & set(path):
                out.append(path)
    return out


def test_repo_paths_named_in_the_docs_exist():
    """Issue 38: every repository path README.md and docs/*.md name in code or links exists in the checkout."""
    missing, checked = [], 0
    for page in _pages():
        for path in repo_paths(page.read_text()):
            checked += 1
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, missing
    assert checked >= 100  # the capability tables name every module, test and benchmark


def test_repo_paths_rule():
    text = ("see `hfscale/compress/qat.py:40`, [x](recipes/tiny/qat.yaml#L3), `benchmarks/results/prune_speed*.md`, "
            "`recipes/<family>/x.yaml`, `runs/tiny/model`, [y](../tools/a.py), `accelerate launch recipes/train_clm.py`, "
            "`tests/test_nothing_here.py`.")
    assert repo_paths(text) == ["hfscale/compress/qat.py", "recipes/train_clm.py", "tests/test_nothing_here.py",
                                "recipes/tiny/qat.yaml"]


def test_every_docs_page_is_linked_and_opens_with_what_ran_where():
    linked = {(README.parent / t).resolve() for t in LINK.findall(README.read_text())}
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert page.resolve() in linked, f"{page.name} is not reachable from the README"
        head = page.read_text().split("\n")[:4]
        assert head[0].startswith("# ") and any(ln.startswith("**What ran where:**") for ln in head), page.name


def test_first_screen_answers_what_install_first_command():
    first = "\n".join(README.read_text().split("\n")[:40])  # one screen
    for needle in ("make demo", "make test", "pip install", "## Quick start"):
        assert needle in first, needle


def commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined."""
    return [c.strip() for c in block.replace("\\\n", " ").split("\n") if c.strip() and not c.lstrip().startswith("#")]


def foreign_lines(output: str, tags=("[train_clm]", "train:")) -> list[str]:
    """Lines of a recipe launch that hfscale did not write: not the recipe's own `[train_clm]` lines nor
    its progress bar (tqdm redraws with carriage returns)."""
    out = []
    for line in output.splitlines():
        parts = [p.strip() for p in line.split("\r") if p.strip()]
        if parts and not all(p.startswith(tags) for p in parts):
            out.append(line)
    return out


OUT_FLAGS = ("--out", "--out-accelerate", "--out-deepspeed", "--output-dir")


def needs(cmds: list[str]) -> list[set[int]]:
    """For each command, the earlier commands it reads from: those that write (an --out / --output-dir value) a path
    it names, or a path under one."""
    writes = []
    for cmd in cmds:
        words = shlex.split(cmd, comments=True)
        writes.append({words[k + 1] for k, w in enumerate(words[:-1]) if w in OUT_FLAGS})
    out = []
    for i, cmd in enumerate(cmds):
        words = shlex.split(cmd, comments=True)
        out.append({j for j in range(i) for w in words for p in writes[j]
                    if w == p or w.startswith(p.rstrip("/") + "/")})
    return out


def test_needs_reads_what_the_block_writes():
    cmds = ["make --out a", "read a/x --out b  # a/x", "read ab a", "read b c --out c", "again --out a"]
    assert needs(cmds) == [set(), {0}, {0}, {1}, {0}]


@pytest.mark.engine
@pytest.mark.slow
def test_quick_start_runs_top_to_bottom(tmp_path):
    """The block as written, command by command, in a directory laid out like a fresh clone after `make demo`
    (.venv, recipes/); every command writes with --force, so it runs twice too. Its `accelerate launch` is also
    the quiet-launch check (issue 30): the recipe's ranks print only hfscale's lines; what is left is at most
    DeepSpeed's "Setting accelerator to CPU", written by accelerate's own launcher process before any hfscale code."""
    for name in ("recipes", "accelerate_configs", "ds_configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))  # `source .venv/bin/activate` finds this suite's venv
    cmds = commands(quick_start())
    assert cmds[0] == "source .venv/bin/activate" and len(cmds) == 8, cmds
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HFSCALE_VERBOSE", None)
    after = needs(cmds[1:])
    # the block's order, read from what each command writes and reads: plan and doctor beside the launch, the two
    # quantizations side by side; any other dependency graph is a README change this test must be told about
    assert after == [set(), {0}, set(), {0}, {3}, {3, 4}, {3}], after
    procs, outs, t0 = {}, {}, time.monotonic()
    try:
        while len(outs) < len(after):  # start each command once the commands it reads from have passed
            for i, cmd in enumerate(cmds[1:]):
                if i not in procs and after[i] <= outs.keys():
                    logs = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # files: a pipe could fill up
                    procs[i] = subprocess.Popen(["bash", "-euo", "pipefail", "-c", f"{cmds[0]}\n{cmd}"], cwd=tmp_path,
                                                stdout=logs[0], stderr=logs[1], text=True, env=env,
                                                start_new_session=True), logs
            finished = [i for i, (p, _) in procs.items() if i not in outs and p.poll() is not None]
            for i in finished:
                p, logs = procs[i]
                out, err = [(f.seek(0), f.read(), f.close())[1] for f in logs]
                outs[i] = subprocess.CompletedProcess(cmds[i + 1], p.returncode, out, err)
                assert p.returncode == 0, (cmds[i + 1], out[-3000:], err[-3000:])
            if not finished:
                assert time.monotonic() - t0 < 1200, "the quick start still runs after 20 min"
                time.sleep(0.2)
    finally:
        from conftest import kill_tree

        for p, _ in procs.values():
            kill_tree(p)  # bash and the launch under it
    outs = {cmds[i + 1].split()[0] + " " + cmds[i + 1].split()[1]: r for i, r in outs.items()}
    assert "pick:" in outs["hfscale plan"].stdout
    launch = outs["accelerate launch"]
    both = launch.stdout + launch.stderr
    assert "[train_clm] eval loss" in both and "10/10" in both
    foreign = foreign_lines(launch.stdout) + foreign_lines(launch.stderr)
    assert len(foreign) <= 1 and all("Setting accelerator to CPU" in ln for ln in foreign), foreign
    assert (tmp_path / "runs/tiny/model/model.safetensors").is_file()
    assert (tmp_path / "runs/tiny_8da4w/config.json").is_file()
    assert "runs/tiny_8da4w" in outs["hfscale eval"].stdout
    gguf = tmp_path / "runs/tiny-Q4_0.gguf"
    assert gguf.is_file() and gguf.stat().st_size > 0 and (tmp_path / "runs/tiny-Q4_0.gguf.json").is_file()


@pytest.mark.parametrize("flag, quiet", [([], True), (["--verbose"], False)])
def test_a_recipe_quiets_its_rank_unless_verbose(flag, quiet, tmp_path):
    """Every recipe parses its arguments with parse_recipe_args before torch is imported; that is where each rank
    installs hfscale/util/quiet.py's filters, and --verbose leaves them out (the quick start's launch above counts the
    lines). A fresh interpreter, no torch: ~1 s."""
    code = ("import logging, sys; from hfscale.train.config import parse_recipe_args; "
            f"parse_recipe_args({flag!r}, 'doc', 'cfg'); "
            "print(bool(logging.getLogger('torchao').filters), type(sys.stdout).__name__, 'torch' in sys.modules)")
    env = {**os.environ}
    env.pop("HFSCALE_VERBOSE", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    filtered, stream, torch_loaded = r.stdout.split()
    assert filtered == str(quiet) and (stream == "_DropPrintedNoise") == quiet and torch_loaded == "False"
