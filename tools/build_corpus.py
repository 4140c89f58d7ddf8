"""Rebuild the embedded corpus shipped in hfscale/models/data/corpus/.

The corpus is English technical prose from CPython 3.11's own documentation: the language
reference topics in ``pydoc_data.topics`` and the docstrings of the pure-Python standard library
(read with ``ast``, nothing is imported). Both are covered by the PSF License, which permits
redistribution with the notice kept (hfscale/models/data/corpus/LICENSE).

The shipped files are fixed, so every machine sees the same train / validation split whatever its
Python version. Run from the repository root:  python tools/build_corpus.py
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import re
import sys
import sysconfig
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "hfscale" / "data" / "corpus"
VALIDATION_PERCENT = 5  # documents whose sha1 % 100 < 5 go to the held-out split
MIN_CHARS = 200  # shorter docstrings are mostly signatures, not prose


def _clean(text: str) -> str:
    text = text.replace("\r\n", "\n").strip()
    return re.sub(r"\n{3,}", "\n\n", text)


def topic_documents():
    import pydoc_data.topics as topics

    for name in sorted(topics.topics):
        yield f"topics/{name}", _clean(topics.topics[name])


def docstring_documents():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo")
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if rel.parts[0] in skip or "tests" in rel.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= MIN_CHARS:
                    yield f"stdlib/{rel}:{getattr(node, 'name', '<module>')}", _clean(doc)


def main() -> int:
    if sys.version_info[:2] != (3, 11):
        print("build the corpus with Python 3.11 so the shipped files stay the same", file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    splits = {"train": [], "validation": []}
    for source, text in [*topic_documents(), *docstring_documents()]:
        digest = hashlib.sha1(text.encode()).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        split = "validation" if int(digest, 16) % 100 < VALIDATION_PERCENT else "train"
        splits[split].append({"source": source, "text": text})
    for split, rows in splits.items():
        # mtime=0 keeps the gzip bytes reproducible
        with gzip.GzipFile(OUT / f"{split}.jsonl.gz", "wb", mtime=0) as f:
            for row in rows:
                f.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
        print(f"{split}: {len(rows)} documents, {sum(len(r['text']) for r in rows):,} chars")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
