"""Preemption: SIGTERM (a scheduler's stop, SLURM's at the time limit) and SIGUSR1 (SLURM's
`--signal=USR1@N`, N seconds before it) ask a run to stop at the next optimizer-step boundary, save a
checkpoint through the staged path (hfscale.train.state), and exit with EXIT_PREEMPTED (75), which
recipes/slurm/multinode.sbatch reads to requeue the job; the requeued job resumes with --resume latest.

The handler only records the request: the step in flight finishes, the ranks agree in the step's own
collective (a rank that saw no signal stops with the others), and a second signal during the save
changes nothing (the save is complete-or-absent either way; a SIGKILL leaves the previous checkpoint).

Launchers must pass the signal on: torchrun (under `accelerate launch`) forwards SIGTERM to the ranks
by default and SIGUSR1 only when told (PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1),
then waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default 30) for them before SIGKILL: give it the
time a checkpoint takes.
"""

from __future__ import annotations

import signal

from .state import EXIT_PREEMPTED

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Set by the handlers; read by the step loop once per step."""

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict = {}

    def __call__(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum

    def install(self) -> "StopRequest":
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self)
        return self

    def uninstall(self) -> None:
        """The handlers from before `install` (after the steps, a signal stops the process as it did before)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else "a stop request on another rank"


class Preempted(Exception):
    """Raised on every rank after the checkpoint at `step` is written; the recipe exits with `status`."""
    status = EXIT_PREEMPTED

    def __init__(self, step: int, why: str):
        super().__init__(f"stopped after step {step} ({why}); checkpoint saved: rerun with --resume latest")
        self.step = step
