"""Rebuild the trained tiny Gemma 3 shipped in hfscale/models/data/trained/ (weights in bf16, safetensors).

It is the built-in tiny Gemma 3 trained by `hfscale.testing.trained` with its default recipe (`TinyTraining()`:
300 steps x 16 x 128 tokens of the built-in corpus, AdamW, warm-up then cosine, seed 0), the fixture every test and
benchmark that needs "a model that has learnt something" starts from. Shipped so that no test run trains it
(it cost 74-144 s of every fresh suite) and so that every host tests the same weights: a seeded init and 300 steps
differ in their last bits between CPUs that dispatch other kernels. Deterministic for a given host and torch.
Run from the repository root:  .venv/bin/python tools/build_trained_tiny.py
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hfscale.models.trained import SHIPPED_FILES, shipped_dir  # noqa: E402
from hfscale.testing.trained import TinyTraining, _train, val_loss  # noqa: E402


def main() -> int:
    import math

    import torch
    from safetensors.torch import load_file, save_file

    recipe = TinyTraining()
    out = shipped_dir()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        info = _train(recipe, Path(tmp), progress=True)
        seconds = time.perf_counter() - t0
        out.mkdir(parents=True, exist_ok=True)
        weights = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(Path(tmp) / "model.safetensors").items()}
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((Path(tmp) / "config.json").read_text())
        cfg["dtype"] = "bfloat16"
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    vl = val_loss(out)
    info.update({
        "shipped_dtype": "bfloat16", "val_loss_first_64_blocks_shipped": vl, "val_ppl_first_64_blocks_shipped": math.exp(vl),
        "train_seconds": round(seconds, 1), "host": {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
                                                     "torch": torch.__version__, "machine": platform.machine()},
        "recipe_key": recipe.key(),
    })
    (out / "hfscale_training.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "model.safetensors").chmod(0o644)  # safetensors writes through a 0600 temporary file
    assert sorted(p.name for p in out.iterdir()) == sorted(SHIPPED_FILES)
    print(f"wrote {out}: {(out / 'model.safetensors').stat().st_size:,} B, trained in {seconds:.0f} s "
          f"({info['host']['cpu_capability']}), val ppl {info['val_ppl_first_64_blocks']:.2f} fp32 / "
          f"{info['val_ppl_first_64_blocks_shipped']:.2f} shipped bf16")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
