"""Preemption: SIGTERM (spot instances, `scancel`, torchrun shutting down) and SIGUSR1 (SLURM's
`--signal`) only set a flag. The loop ORs the flag over all ranks at the next step boundary, so
every rank saves the same step and exits together with PREEMPTED_EXIT_CODE. DataLoader workers
ignore both signals (`ignore_stop_signals`): the trainer decides when to stop."""
from __future__ import annotations

import signal

# EX_TEMPFAIL from sysexits.h: "try again later". A checkpoint was saved; `--resume` continues.
PREEMPTED_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopFlag:
    def __init__(self):
        self.signal_name: str | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    @property
    def raised(self) -> bool:
        return self.signal_name is not None


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader `worker_init_fn`. torchrun signals each trainer's whole process group, its loader
    workers included, and torch's own SIGTERM handler in a worker exits unless the signal came from
    the trainer: the trainer then fails ("DataLoader worker ... is killed by signal") before it can
    save. Ignoring the signals leaves the worker to the trainer, which shuts it down on exit (and a
    worker whose trainer died exits by itself)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
