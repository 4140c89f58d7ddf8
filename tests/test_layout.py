"""The package layout shows the architecture (STYLE.md pattern 15): subpackages only at the top, imports one-way
between them (no cycles), test support kept out of the package's own imports, and the old module paths users
import still giving the same module objects."""

import importlib
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import hfscale

PKG = Path(hfscale.__file__).parent


def _imports() -> dict[str, set[str]]:
    """Subpackage -> the subpackages its relative imports (module level or lazy) reach."""
    edges: dict[str, set[str]] = defaultdict(set)
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG)
        if len(rel.parts) == 1:
            continue
        here = ["hfscale", *rel.parts[:-1]]
        for m in re.finditer(r"^\s*from (\.+)([\w.]*) import", p.read_text(), re.M):
            dots, name = len(m.group(1)), m.group(2)
            target = here[: len(here) - (dots - 1)] + (name.split(".") if name else [])
            if len(target) > 1 and target[1] != rel.parts[0]:
                edges[rel.parts[0]].add(target[1])
    return edges


def test_top_level_holds_subpackages_only():
    loose = sorted(p.name for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert loose == [], f"loose modules beside the subpackages: {loose}"
    subs = sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file())
    assert {"util", "models", "data", "scale", "plan", "doctor", "train", "compress", "export", "experts", "proofs", "cli",
            "testing"} == set(subs)


def test_subpackages_import_one_way():
    edges = _imports()

    def reach(a, seen):
        for b in edges.get(a, ()):
            if b not in seen:
                seen.add(b)
                reach(b, seen)
        return seen

    cycles = sorted((a, b) for a in edges for b in edges[a] if a in reach(b, set()))
    assert cycles == []
    # the layers from the bottom: nothing below imports what is above it
    assert edges["util"] == set()
    assert edges["models"] <= {"util"}
    assert edges["data"] <= {"util", "models"}  # the data layer: no accelerate, no process groups (staged renames)
    assert edges["scale"] <= {"util", "models"}
    assert "testing" not in set().union(*(v for k, v in edges.items() if k != "testing")), "the package imports its test support"


@pytest.mark.parametrize("old, new", sorted(hfscale._MOVED.items()))
def test_old_module_paths_import_the_moved_module(old, new):
    assert importlib.import_module(f"hfscale.{old}") is importlib.import_module(f"hfscale.{new}")


def test_names_users_import_keep_working():
    from hfscale.checkpointing import apply_checkpointing_
    from hfscale.models import build_model, load_tokenizer
    from hfscale.proof import launch

    assert hfscale.models.build_model is build_model and hfscale.proof.launch is launch
    assert apply_checkpointing_.__module__ == "hfscale.scale.checkpointing" and callable(load_tokenizer)
    assert hfscale.corpus.__name__ == "hfscale.data.corpus"
    from hfscale.models.corpus import load_text  # the old path of the corpus module

    assert load_text is hfscale.data.corpus.load_text


def test_import_hfscale_and_the_old_paths_stay_light():
    code = "import sys, hfscale, hfscale.errors, hfscale.atomic, hfscale.models; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
