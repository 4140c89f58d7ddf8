import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, cwd=None, timeout=600, env=None):
    """Run the installed `hfscale` console script as a user would; returns CompletedProcess.
    `env` adds to (or overrides) this process's environment."""
    exe = shutil.which("hfscale", path=str(Path(sys.executable).parent)) or "hfscale"
    return subprocess.run([exe, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def root():
    return ROOT
