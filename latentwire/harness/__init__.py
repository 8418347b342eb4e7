"""The model-agnostic harness under train.py: copy this folder into another repo as it is.

What a hand-written data-parallel training loop needs besides its model, each in a module of its
own with a narrow interface: the process group and its collectives (`distributed`), numerics and
attention kernels (`precision`), the compile settings and cache (`compiling`), the sharded
sampler, loader and global batches (`data`), checkpoint and bitwise resume (`checkpoint`),
preemption (`preemption`), throughput, MFU and memory (`metrics`, the FLOP count handed in),
the profiler and memory snapshots (`profiling`), errors and exit codes (`errors`), a launcher that
ends with the run's own code (`launch`), and settings from hardware profiles and flags (`config`,
the schema handed in). It imports nothing outside this folder but torch, numpy, safetensors and
TensorBoard, and names no model.

`tests/toy_train.py` is the smallest loop built from it (a regression model, exact accumulation
over ranks, one host sync per step, resume, preemption), and `tests/test_harness.py` its tests:
`python -m pytest harness/tests` from the folder that holds the copy.
"""
