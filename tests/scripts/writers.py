"""Run hfscale's writers in one process, optionally SIGKILLed at a chosen call (tests/test_outputs.py).

    python tests/scripts/writers.py [--kill-at MODULE:ATTR[:N][:after]] STEP [+ STEP ...]

    STEP  cli ARGS...          `hfscale ARGS` (hfscale.cli.main)
          ckpt OUTPUT_DIR N    a checkpoint save at step N (train.state.Checkpoints) of the tiny model
          final OUT            the consolidated save (train.state.save_final) of the tiny model

--kill-at replaces ATTR (dotted, inside MODULE) by a function that sends this process SIGKILL, as
an OOM killer or a lost node would: at its N-th call (default 1), before the original runs, or
right after it returned with `:after`. The hook lives here, in the test; production code reads no
environment for it. A step that fails exits with its code at once.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys


def arm(spec: str) -> None:
    mod, attr, *rest = spec.split(":")
    after = "after" in rest
    nth = next((int(r) for r in rest if r.isdigit()), 1)
    owner = importlib.import_module(mod)
    *path, name = attr.split(".")
    for p in path:
        owner = getattr(owner, p)
    original = getattr(owner, name)
    calls = [0]

    def hook(*a, **k):
        calls[0] += 1
        if calls[0] != nth:
            return original(*a, **k)
        if after:
            original(*a, **k)
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(owner, name, hook)


_trainer: dict = {}


def trainer():
    """One CPU process: accelerator, prepared tiny model + optimizer, tokenizer (built once)."""
    if not _trainer:
        import torch
        from accelerate import Accelerator

        from hfscale.models import TINY, build_model, load_tokenizer

        acc = Accelerator(cpu=True)
        model = build_model(TINY, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        _trainer.update(acc=acc, model=model, tok=load_tokenizer(TINY))
    return _trainer


def run(step: list[str]) -> int:
    kind, *args = step
    if kind == "cli":
        from hfscale.cli import main

        return main(args)
    if kind == "ckpt":
        from hfscale.train.state import Checkpoints

        t = trainer()
        Checkpoints(args[0], keep_last=2).save(t["acc"], int(args[1]), {"model": "tiny-gemma3"})
        return 0
    if kind == "final":
        from hfscale.train.state import save_final

        t = trainer()
        save_final(t["acc"], t["model"], t["tok"], args[0])
        return 0
    raise SystemExit(f"unknown step {kind!r}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--kill-at"]:
        arm(argv[1])
        argv = argv[2:]
    steps, cur = [], []
    for a in argv + ["+"]:
        if a == "+":
            steps.append(cur)
            cur = []
        else:
            cur.append(a)
    for step in steps:
        rc = run(step)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
