"""A 1-layer tiny Gemma 3: the built-in model (random init) pruned to its first layer by `hfscale.compress.prune`,
saved as a transformers directory with the tokenizer. A quick source for tests about files, runtimes and staging
rather than quality: ExecuTorch's lowering time grows with the layers of the graph (the 4-layer model takes 35 s
in fp32 on 2 cores)."""

from __future__ import annotations

from pathlib import Path


def one_layer_tiny(out: str | Path) -> Path:
    from ..compress.evaluate import calibration_blocks
    from ..compress.prune import PruneTarget, prune
    from ..compress.save import save_model_dir
    from ..models import build_model, load_tokenizer

    tok = load_tokenizer("tiny-gemma3")
    small, _ = prune(build_model("tiny-gemma3").eval(), PruneTarget(layers=1), calibration_blocks(tok, 2, 32))
    save_model_dir(small, out, tokenizer=tok)
    return Path(out)
