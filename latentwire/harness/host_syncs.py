"""Counting a loop's host syncs on any device, a CPU included: every call that reads a tensor's
value on the host is one on CUDA, where it stalls the host until the device has caught up. A loop
that promises one sync per step tests it with `HostReads`: run N and M steps, compare the counts."""

from __future__ import annotations

import traceback

from torch.overrides import TorchFunctionMode


class HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's value on the host. Calls made by the DataLoader (host
    tensors by design) and by the optimizer (on CUDA it is fused and reads nothing; on CPU its step
    counters are host tensors) are left out."""

    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS and not self._host_side():
            self.count += 1
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _host_side() -> bool:
        return any(("torch/utils/data" in f.filename or "torch/optim" in f.filename) for f in traceback.extract_stack())
