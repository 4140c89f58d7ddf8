import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# step traces are cached; tests keep theirs out of the user's ~/.cache
os.environ.setdefault("HFSCALE_CACHE", os.path.join(os.environ.get("TMPDIR", "/tmp"), f"hfscale-test-cache-{os.getuid()}"))
# `make test` runs the in-process tests on two pytest-xdist workers (the Makefile); the second keeps a cache of its own,
# so the two never build one entry at the same moment (safe, hfscale.util.atomic, but twice the CPU: a race to a
# tie) and no test reads a half-filled listing of another worker's; the first shares the serial part's cache
if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
    os.environ["HFSCALE_CACHE"] += "-" + os.environ["PYTEST_XDIST_WORKER"]

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, cwd=None, timeout=600, env=None):
    """Run the installed `hfscale` console script as a user would; returns CompletedProcess.
    `env` adds to (or overrides) this process's environment."""
    exe = shutil.which("hfscale", path=str(Path(sys.executable).parent)) or "hfscale"
    return subprocess.run([exe, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def run_cli_concurrently(*calls, cwd=None, timeout=600, env=None, at_once=4):
    """Several independent `hfscale` CLI runs, each a real process as run_cli starts it, up to `at_once` of them at a
    time so their imports (2-3 s each) overlap on the suite's 2 cores; returns their CompletedProcess in the order
    given. A call is an argument sequence, or a dict {"args": ..., "cwd": ...} for a run in a directory of its own;
    use it only for runs that read nothing another of them writes."""
    exe = shutil.which("hfscale", path=str(Path(sys.executable).parent)) or "hfscale"
    jobs = [(c["args"], c.get("cwd", cwd)) if isinstance(c, dict) else (c, cwd) for c in calls]
    return run_concurrently([([exe, *args], where) for args, where in jobs], timeout=timeout,
                            env={"HF_HUB_OFFLINE": "1", **(env or {})}, at_once=at_once)


def run_concurrently(jobs, timeout=600, env=None, at_once=2):
    """Independent commands, (argv, cwd) each, up to `at_once` of them at a time (what one process leaves of the 2
    cores idle, in its single-threaded imports and Python work, the next one uses); returns their CompletedProcess
    in the order given. `env` adds to this process's environment."""
    import time

    full_env = {**os.environ, **(env or {})}
    procs, out, deadline = [], [], time.monotonic() + timeout

    def start(k):
        argv, where = jobs[k]
        procs.append(subprocess.Popen([str(a) for a in argv], cwd=where, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=full_env, start_new_session=True))

    try:
        for k in range(min(at_once, len(jobs))):
            start(k)
        for k in range(len(jobs)):  # a process blocked on a full pipe waits for its turn to be read: no deadlock
            stdout, stderr = procs[k].communicate(timeout=max(deadline - time.monotonic(), 1))
            out.append(subprocess.CompletedProcess(procs[k].args, procs[k].returncode, stdout, stderr))
            if len(procs) < len(jobs):
                start(len(procs))
    finally:
        for p in procs:
            kill_tree(p)
    return out


def selected_params(request, test_name: str) -> list:
    """The callspecs of this session's selected items of the parametrized test `test_name`: what a module fixture that
    runs every selected case's slow part at once (side by side) must run, and no more."""
    return [item.callspec for item in request.session.items
            if item.originalname == test_name and getattr(item, "callspec", None)]


_PORTS: set = set()


def fresh_port() -> int:
    """A free port no launch of this session was given: launches started side by side never share one."""
    from hfscale.proofs.engine import free_port

    while (port := free_port()) in _PORTS:
        pass
    _PORTS.add(port)
    return port


def kill_tree(p) -> None:
    """A process started with start_new_session=True, and everything it started (a launch's ranks), killed and
    reaped if it still runs: a failed test leaves nothing on the host's 2 cores."""
    import signal

    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under root (hidden ones too, symlinks not followed) -> sha256 of a file, 'dir', or a
    link's target: compare two snapshots to see what a command created, changed or removed."""
    import hashlib

    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return dict(sorted(out.items()))


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def root():
    return ROOT


# --- tiers: `make test-fast` runs -m "not engine and not slow" (a few minutes) ---------------------------------
# `engine` is marked where a test launches processes; `slow` is marked on the test (tests/test_install.py,
# tests/test_readme.py) or here, for what a test file or fixture does rather than what it asserts:
# fixtures that train or feed slow work: `trained` (the tiny fixture, copied from the shipped weights; its tests export
# and run what it holds), `pair` (test_distill_recipe: a
# 40-step teacher and its pruned student)
SLOW_FIXTURES = {"trained", "pair"}
ENGINE_FIXTURES = {"uninterrupted_run"}  # test_recipe: a 2-process ZeRO-2 run the elastic tests compare against
SLOW_TESTS = {  # file -> test-name prefixes ("" = every test in the file): why
    "test_bench.py": ("",),                    # llama.cpp and ExecuTorch runs, one process per measurement
    "test_export_pte.py": ("",),               # ExecuTorch lowering (~75 s) and runtime
    "test_export_gguf.py": ("",),              # llama.cpp loads and runs every GGUF
    "test_export_gguf_gemma4.py": ("",),       # llama.cpp runs, trained Gemma 4 shapes
    "test_export_gguf_moe.py": ("",),          # llama.cpp runs of MoE GGUFs
    "test_export_gguf_families.py": ("",),     # llama.cpp runs, Llama / Mistral / Qwen shapes and a LoRA
    "test_outputs.py": ("test_kill_gguf", "test_kill_pte", "test_kill_checkpoint", "test_kill_quantize"),  # real exports / saves killed
    "test_profile.py": ("test_one_process_timeline",),  # real steps in a subprocess
    "test_cli_refusals.py": ("test_weight_only_ptq",),  # two real PTQ runs (quantize, save, reload, compare)
    "test_outputs.py#umask": ("test_every_writer_gets_the_umask_modes",),  # every writer for real, twice
    "test_trace.py": ("test_fake_trace_equals_real_steps", "test_plan_trace_any_architecture"),  # real steps, 13 families
    "test_prune.py": ("test_params_target_saves",),  # prune + save + reload per family
}
# slow, but mostly one busy core (pip and venv builds, CLI subprocesses; test_core_verbs_run starts a few at once for
# seconds): `onecore` lets `make test` run them beside the in-process tests on the two xdist workers rather than alone
# in the second part (Makefile: PART1 / PART2)
ONECORE_TESTS = {
    "test_install.py": ("",),                  # a venv, pip and a wheel build; the core verbs in it (~20 s)
    "test_trace.py": ("test_plan_trace_any_architecture",),  # four `hfscale plan` runs, fake tensors, one after another
    "test_prune.py": ("test_params_target_saves",),  # prune in this process, a reload in one subprocess
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        prefixes = [p for k, v in SLOW_TESTS.items() if k.split("#")[0] == item.path.name for p in v]
        if SLOW_FIXTURES & set(item.fixturenames) or any(item.name.startswith(p) for p in prefixes):
            item.add_marker(pytest.mark.slow)
        if ENGINE_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.engine)
        if any(item.name.startswith(p) for p in ONECORE_TESTS.get(item.path.name, ())):
            item.add_marker(pytest.mark.onecore)


@pytest.fixture
def fresh_accelerate():
    """accelerate's process-wide singletons (AcceleratorState, GradientState) cleared before and after a test that
    builds an Accelerator in the suite's own process, as accelerate's own test case does: an in-process HF Trainer
    leaves its state behind (seen: after tests/test_data.py's Trainer tests, the packed-step update of
    tests/test_documents.py missed -lr x gradient by 1-3%)."""
    from accelerate.state import AcceleratorState, GradientState

    def reset():
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    reset()
    yield
    reset()
