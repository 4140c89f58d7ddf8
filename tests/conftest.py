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

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, cwd=None, timeout=600, env=None):
    """Run the installed `hfscale` console script as a user would; returns CompletedProcess.
    `env` adds to (or overrides) this process's environment."""
    exe = shutil.which("hfscale", path=str(Path(sys.executable).parent)) or "hfscale"
    return subprocess.run([exe, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


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
