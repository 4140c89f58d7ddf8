"""Build the embedded chat set shipped in hfscale/models/data/chat/ from the embedded corpus.

Every conversation is cut from one document of the built-in corpus (CPython 3.11's documentation prose,
PSF License: hfscale/models/data/corpus/LICENSE, which covers this derived set too): the user quotes a few
paragraphs (or asks for the next ones) and the assistant answers with the document's following paragraph(s);
some conversations carry a system turn, some a second exchange. Lengths spread like real chat sets (a few
dozen to several hundred tokens). Train conversations come from the corpus's train split, validation ones
from its validation split, so nothing held out was trained on. Deterministic (a seeded generator, no clock):
rerunning gives the same bytes. Run from the repository root:  python tools/build_chat.py
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "hfscale" / "models" / "data" / "corpus"
OUT = ROOT / "hfscale" / "models" / "data" / "chat"
ASKS = ["Continue this passage from the Python documentation:", "What comes next in the Python docs after this?",
        "Here is part of the Python documentation. Go on:", "Keep going from where this text stops:"]
FOLLOW = ["Go on.", "And after that?", "Continue, please.", "What follows?"]
SYSTEM = "You continue passages of the Python documentation faithfully."


def paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if 40 <= len(p.strip()) <= 900]


def conversations(docs: list[str], rng: random.Random, per_doc: int):
    for text in docs:
        paras = paragraphs(text)
        for _ in range(min(per_doc, max(0, len(paras) - 2))):
            k = rng.randint(1, min(3, len(paras) - 2))
            at = rng.randint(0, len(paras) - k - 1)
            m = rng.choice([1, 1, 1, 2])
            conv = []
            if rng.random() < 0.3:
                conv.append({"role": "system", "content": SYSTEM})
            conv.append({"role": "user", "content": rng.choice(ASKS) + "\n\n" + "\n\n".join(paras[at:at + k])})
            conv.append({"role": "assistant", "content": "\n\n".join(paras[at + k:at + k + m])})
            nxt = at + k + m
            if nxt < len(paras) and rng.random() < 0.35:
                conv.append({"role": "user", "content": rng.choice(FOLLOW)})
                conv.append({"role": "assistant", "content": paras[nxt]})
            yield {"messages": conv}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for split, per_doc in (("train", 2), ("validation", 2)):
        docs = [json.loads(line)["text"] for line in gzip.open(CORPUS / f"{split}.jsonl.gz", "rt")]
        rows = list(conversations(docs, random.Random(f"hfscale-chat-{split}"), per_doc))
        raw = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
        with open(OUT / f"{split}.jsonl.gz", "wb") as f:  # mtime 0 and no name: the same bytes on every run
            with gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as g:
                g.write(raw)
        print(f"{split}: {len(rows)} conversations, {len(raw):,} bytes -> {OUT / (split + '.jsonl.gz')}")
    (OUT / "LICENSE").write_text("Derived by tools/build_chat.py from the built-in corpus (CPython 3.11 documentation "
                                 "prose);\nthe PSF License of ../corpus/LICENSE applies, its notice kept there.\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
