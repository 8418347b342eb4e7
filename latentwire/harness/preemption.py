"""Stopping a run without losing it: a scheduler's signal (SIGTERM from spot instances, `scancel`
or torchrun shutting down; SIGUSR1, SLURM's `--signal`), a hangup (SIGHUP: an ssh connection
dropped, a terminal closed) and a person's Ctrl-C (SIGINT) only set a flag. The ranks agree on it at
the next step boundary (it rides the step's own all-reduce), between evaluation chunks and once
before the first step, so every rank saves the same step and exits together: 75 for a scheduler's
signal or a hangup (errors.PREEMPTED_EXIT_CODE: resume), 130 for Ctrl-C
(errors.INTERRUPTED_EXIT_CODE, the shell's: not a preemption to requeue). A second Ctrl-C stops at
once, without saving the step; a second hangup does not (one dropped connection can deliver two:
the login shell's to its jobs and the kernel's when that shell exits). DataLoader workers are kept
out of the way of all of them (`shield_worker_from_stop_signals`): the trainer decides when to stop."""

from __future__ import annotations

import os
import select
import signal

import torch
import torch.distributed as dist

from .distributed import all_reduce
from .errors import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE
from .outcomes import record_outcome

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


class StopFlag:
    """Installs the handlers; `flags(device)` is what a rank heard, for the step's all-reduce.
    `announce`: this rank says so on stderr when it hears a Ctrl-C (rank 0: once per run)."""

    def __init__(self, announce: bool):
        self.signal_name: str | None = None
        self.interrupted = False
        self.announce = announce
        self.deliveries = signal_deliveries()
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        signal.signal(signal.SIGINT, self._interrupt)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGHUP:
            mute_a_lost_console()
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def _interrupt(self, signum, frame) -> None:
        # Python runs a handler once the main thread is back in the interpreter, so two Ctrl-Cs
        # within one long C++ call (a step's backward) run it once: counted as one, this rank would
        # go on to save while its peers had stopped at once, and fail in the next collective. The
        # interpreter's C-level handler writes a byte for every delivery: count those instead.
        if self.interrupted or drain(self.deliveries).count(signal.SIGINT) > 1:
            self._say("interrupted again: stopping now, without saving this step")
            record_outcome(INTERRUPTED_EXIT_CODE, None)
            os._exit(INTERRUPTED_EXIT_CODE)
        self.interrupted = True
        self.signal_name = self.signal_name or "SIGINT"
        self._say("interrupted: the run saves at the end of this step and stops (Ctrl-C again: stop at once, unsaved)")

    def _say(self, line: str) -> None:
        # os.write, not print: a handler that prints while the interrupted code was printing to the
        # same buffered stream raises "reentrant call".
        if self.announce:
            os.write(2, (line + "\n").encode())

    @property
    def raised(self) -> bool:
        return self.signal_name is not None

    def flags(self, device: torch.device) -> torch.Tensor:
        """[a scheduler's signal heard, a Ctrl-C heard], as 0/1; summed or maxed over the ranks,
        `stop_code` turns them into the run's exit code."""
        return torch.tensor([int(self.raised and not self.interrupted), int(self.interrupted)], device=device)

    def on_any_rank(self, device: torch.device) -> int | None:
        """Collective: the exit code any rank's signal calls for, None if no rank heard one. For the
        phases between steps (loading, evaluation); within a step the flags ride the step's own
        all-reduce instead."""
        return stop_code(*all_reduce(self.flags(device), dist.ReduceOp.MAX).tolist())


def mute_a_lost_console(fds: tuple[int, ...] = (1, 2)) -> None:
    """Stdout and stderr pointed at /dev/null where no one reads them any more: a terminal that hung
    up (writes fail with EIO) or a pipe whose other end the hangup closed (`| tee log`: EPIPE). A line
    printed there would end the run before it saved. Either shows in poll() as an error or a hangup."""
    poll = select.poll()
    for fd in fds:
        poll.register(fd, select.POLLOUT)
    lost = [fd for fd, events in poll.poll(0) if events & (select.POLLERR | select.POLLHUP)]
    if lost:
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in lost:
            os.dup2(null, fd)
        os.close(null)


def signal_deliveries() -> int:
    """The read end of a pipe into which the interpreter writes each signal's number as it is
    delivered (signal.set_wakeup_fd), one per process."""
    global _deliveries
    if _deliveries is None:
        read, write = os.pipe()
        for fd in (read, write):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(write)
        _deliveries = read
    return _deliveries


_deliveries: int | None = None


def drain(fd: int) -> bytes:
    """Everything a non-blocking pipe holds now."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def stop_code(scheduler: int, person: int) -> int | None:
    """The exit code every rank agrees on from the flags of all ranks: a Ctrl-C anywhere is a
    person stopping the run (130), else a scheduler's signal is a preemption (75)."""
    return INTERRUPTED_EXIT_CODE if person else PREEMPTED_EXIT_CODE if scheduler else None


def shield_worker_from_stop_signals(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: the worker leaves the trainer's process group. torchrun signals
    each trainer's whole process group, and torch's SIGTERM handler in a worker exits when the
    signal did not come from its trainer: the trainer then failed ("DataLoader worker ... is killed
    by signal") before it could save. Outside the group only the trainer stops its workers (its
    SIGTERM still ends them), and a worker whose trainer died exits by itself. SIGUSR1, which no
    trainer sends, and SIGINT, whose handler the worker inherited from its trainer, are ignored."""
    os.setpgrp()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
