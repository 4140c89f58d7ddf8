"""How often a finished 2-rank run loses a rank at exit (SIGABRT, "terminate called without an active exception"),
per ending: tests/scripts/exit_probe.py (the end of a run and nothing else: a DeepSpeed-over-gloo process group,
the last collectives, the exit) launched N times per ending, the endings interleaved, each rank's own exit status
recorded by a shell around it (the launcher reports only the first failure).

    python benchmarks/exit_race.py [--launches 16]     ->  benchmarks/results/exit_race.md

Endings (see the probe): bare = no hfscale (a user's script or HF Trainer before this fix), trainer = the same with
hfscale.training_arguments_kwargs called (its atexit process-group teardown), recipe = hfscale.make_accelerator and
hfscale.exit_rank (the recipes', proof's and profile's ending). tests/test_exit.py repeats the two hfscale endings.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROBE = ROOT / "tests" / "scripts" / "exit_probe.py"


def launch(ending: str, out: Path, timeout: int = 300) -> tuple[list[int | None], int, str]:
    """One `accelerate launch` (zero2.yaml, 2 processes) of the probe with `ending`: each rank's exit status (None:
    the rank was killed by the launcher after another failed), the launcher's status, its output."""
    from hfscale.proofs.engine import free_port

    out.mkdir(parents=True)
    rank = f"{shlex.quote(sys.executable)} {shlex.quote(str(PROBE))} {ending} {shlex.quote(str(out))}"
    wrapper = f"{rank}; s=$?; echo $s > {shlex.quote(str(out))}/status_rank$RANK; exit $s"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs" / "zero2.yaml"),
           "--num_processes", "2", "--num_machines", "1", "--machine_rank", "0", "--main_process_port", str(free_port()),
           "--no_python", "sh", "-c", wrapper]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    statuses = [int(p.read_text()) if p.exists() else None for p in (out / f"status_rank{i}" for i in (0, 1))]
    return statuses, r.returncode, r.stdout + r.stderr


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=16, help="launches per ending")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "exit_race.md"))
    args = ap.parse_args(argv)
    endings = ("bare", "trainer", "recipe")
    rows = {e: {"launches": 0, "aborted": 0, "rank_statuses": [], "seconds": 0.0} for e in endings}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.launches):
            for e in endings:
                t0 = time.perf_counter()
                statuses, rc, log = launch(e, Path(tmp) / f"{i}_{e}")
                row = rows[e]
                row["seconds"] += time.perf_counter() - t0
                row["launches"] += 1
                row["aborted"] += int(rc != 0 or statuses != [0, 0])
                row["rank_statuses"] += statuses
                print(f"{i} {e}: ranks {statuses}, launcher {rc}"
                      + (" (terminate called without an active exception)" if "terminate called" in log else ""), flush=True)
    lines = ["# Exit race: finished 2-rank runs that lose a rank at exit", "",
             f"`python benchmarks/exit_race.py --launches {args.launches}`, {time.strftime('%Y-%m-%d')}; "
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores shared with other jobs; "
             "accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 2 (DeepSpeed over gloo, CPU) "
             "of tests/scripts/exit_probe.py, endings interleaved.", "",
             "| ending | launches | launches with a rank not exiting 0 | rank statuses seen | s / launch |", "|---|---|---|---|---|"]
    for e, row in rows.items():
        seen = ", ".join(f"{s if s is not None else 'killed by the launcher'} x{row['rank_statuses'].count(s)}"
                         for s in sorted(set(row["rank_statuses"]), key=lambda s: (s is None, s)))
        lines.append(f"| {e} | {row['launches']} | {row['aborted']} ({row['aborted'] / row['launches']:.0%}) | {seen} | "
                     f"{row['seconds'] / row['launches']:.1f} |")
    lines += ["", "134 = 128 + SIGABRT: 'terminate called without an active exception' (a gloo worker thread taking the GIL "
              "during interpreter finalization; hfscale.scale.runtime.exit_rank). bare: no hfscale; trainer: "
              "training_arguments_kwargs's atexit process-group teardown, normal exit; recipe: make_accelerator + exit_rank.", ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
