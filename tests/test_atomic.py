import os

import pytest

from hfscale.util.atomic import check_writable, write_text_atomic
from hfscale.util.errors import HfscaleError


def test_atomic_write_replaces_whole_and_leaves_no_temp(tmp_path):
    p = tmp_path / "a" / "x.json"
    write_text_atomic(p, "one")
    write_text_atomic(p, "two")
    assert p.read_text() == "two"
    assert os.listdir(p.parent) == ["x.json"]


def test_failed_write_keeps_old_content(tmp_path, monkeypatch):
    p = tmp_path / "x.txt"
    p.write_text("old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        write_text_atomic(p, "new")
    assert p.read_text() == "old"
    assert os.listdir(tmp_path) == ["x.txt"]


def test_check_writable(tmp_path):
    (tmp_path / "a").write_text("x")
    with pytest.raises(HfscaleError, match="--force"):
        check_writable([tmp_path / "b", tmp_path / "a"], force=False)
    check_writable([tmp_path / "a"], force=True)
