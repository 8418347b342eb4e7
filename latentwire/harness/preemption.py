"""Preemption: SIGTERM (spot instances, `scancel`, torchrun shutting down) and SIGUSR1 (SLURM's
`--signal`) only set a flag. The ranks OR the flag at the next step boundary, between evaluation
chunks and once before the first step, so every rank saves the same step and exits together with
errors.PREEMPTED_EXIT_CODE. DataLoader workers are kept out of the way of both
(`shield_worker_from_stop_signals`): the trainer decides when to stop."""
from __future__ import annotations

import os
import signal

import torch

from .distributed import all_reduce_max

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

    def on_any_rank(self, device: torch.device) -> bool:
        """Collective: whether any rank has been signalled. For the phases between steps (loading,
        evaluation); within a step the flag rides along the step's own all-reduce instead."""
        return bool(all_reduce_max(torch.tensor([int(self.raised)], device=device)).item())


def shield_worker_from_stop_signals(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: the worker leaves the trainer's process group. torchrun signals
    each trainer's whole process group, and torch's SIGTERM handler in a worker exits when the
    signal did not come from its trainer: the trainer then failed ("DataLoader worker ... is killed
    by signal") before it could save. Outside the group only the trainer stops its workers (its
    SIGTERM still ends them), and a worker whose trainer died exits by itself. SIGUSR1, which no
    trainer sends, is ignored."""
    os.setpgrp()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
