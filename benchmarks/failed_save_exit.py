"""How often a rank of a 2-rank run whose save fails on a full disk never reaches its own exit status, with and without
hfscale.scale.runtime.hold_process_groups, on a loaded host (the condition a clean-clone `make test` met).

The run is tests/test_recipe.py's full-disk case: recipes/train_clm.py under accelerate launch (ddp.yaml, 2 processes,
gloo) writing into a 56 MiB tmpfs, --save-every 1 --keep-last 2, so the save of step 2 fails with ENOSPC on rank 0
and every rank should leave with 74. Each rank's status is recorded by tests/scripts/faulty_recipe.py (`record@`)
after the recipe's main() returned; `unheld` there turns hold_process_groups off. BUSY processes spin beside the
launches (default 3 on this 2-core host).

    as root (it mounts a tmpfs):
    python benchmarks/failed_save_exit.py [--launches 40 --unheld 30 --busy 3]  ->  benchmarks/results/failed_save_exit.md
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def launch(work: Path, held: bool) -> tuple[list[str | None], float, bool]:
    """One full-disk launch (tests/test_recipe.py's launch and arguments): each rank's recorded status (None: never
    recorded), seconds, whether torchrun had to SIGKILL a rank that ignored its SIGTERM."""
    from tests.test_recipe import launch as launch_recipe

    mnt = work / "small"
    mnt.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=56m", "tmpfs", str(mnt)], check=True)
    try:
        t0 = time.perf_counter()
        _, log = launch_recipe("ddp.yaml", mnt / "run", "--max-steps", "3", "--save-every", "1", "--keep-last", "2",
                               fault=f"record@{work}" + ("" if held else ",unheld"), check=False, log_dir=work)
        seconds = time.perf_counter() - t0
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    status = [(work / f"exit_rank{i}.txt").read_text() if (work / f"exit_rank{i}.txt").exists() else None for i in (0, 1)]
    return status, seconds, "forcefully exiting via 9" in log


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=40, help="launches with hold_process_groups (hfscale's ending)")
    ap.add_argument("--unheld", type=int, default=30, help="launches with it turned off")
    ap.add_argument("--busy", type=int, default=3, help="spinning processes beside the launches")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "failed_save_exit.md"))
    args = ap.parse_args(argv)
    import torch

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    rows = {True: [], False: []}
    order = []  # interleaved, so load and host state fall on both alike
    for i in range(max(args.launches, args.unheld)):
        order += [False] * (i < args.unheld) + [True] * (i < args.launches)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i, held in enumerate(order):
                status, seconds, killed = launch(Path(tmp) / str(i), held)
                rows[held].append((status, seconds, killed))
                print(f"{i} {'held' if held else 'unheld'}: ranks {status}, {seconds:.1f} s" + (", SIGKILL" if killed else ""),
                      flush=True)
    finally:
        for p in busy:
            p.kill()
    cpu = torch.backends.cpu.get_cpu_capability()
    lines = ["# A failed save on a full disk: does every rank reach its exit status 74?", "",
             f"`python benchmarks/failed_save_exit.py --launches {args.launches} --unheld {args.unheld} --busy {args.busy}`, "
             f"{time.strftime('%Y-%m-%d')}; {platform.machine()}, {os.cpu_count()} cores, torch CPU capability {cpu}, "
             f"{args.busy} busy processes beside; torch {torch.__version__}. tests/test_recipe.py's full-disk run "
             "(ddp.yaml, 2 processes, gloo, a 56 MiB tmpfs), launches interleaved.", "",
             "| ending | launches | a rank never recorded 74 | of those, SIGKILLed by torchrun after 30 s | s / launch |",
             "|---|---|---|---|---|"]
    for held, name in ((False, "hold_process_groups off"), (True, "hfscale (groups held to exit_rank)")):
        rs = rows[held]
        if not rs:
            continue
        lost = [r for r in rs if r[0] != ["74", "74"]]
        lines.append(f"| {name} | {len(rs)} | {len(lost)} ({len(lost) / len(rs):.0%}) | {sum(r[2] for r in lost)} | "
                     f"{sum(r[1] for r in rs) / len(rs):.1f} |")
    lines += ["", "A rank that never recorded its status deadlocked freeing a gloo process group (gdb, once: "
              "~ProcessGroupGloo joining its worker with the GIL held, the worker in ~AsyncBroadcastWork waiting for the "
              "GIL); torchrun then SIGKILLs it 30 s after the first rank left. hfscale.scale.runtime.hold_process_groups "
              "keeps every group to os._exit.", ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
