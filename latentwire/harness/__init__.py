"""The model-agnostic harness under train.py: copy this folder into another repo as it is.

What a hand-written data-parallel training loop needs besides its model, each in a module of its
own with a narrow interface:

- the seam to the model: what the loop's setup and step ask of it (`recipe`: a small required
  core, the rest with defaults), and a whole recipe for a toy regression to start from (`template`);
- settings, each declared once as a field of a typed section, and the profiles, flags and --help
  that follow from them (`config`); the loop's own sections and command line, which a model's
  configuration extends (`loop_config`);
- the process group and its collectives (`distributed`); numerics and attention kernels
  (`precision`); the compile settings and cache (`compiling`);
- data: the sharded sampler, loader and global batches (`data`), and how large they are on the
  world that runs them (`layout`);
- the run's directory, one run at a time (`out_dir`); checkpoints written whole (`checkpoint`),
  which one a run resumes and what it may not change (`resume`), and the training data's identity
  each records (`data_identity`);
- preemption and Ctrl-C (`preemption`); errors and exit codes (`errors`), each rank's outcome for
  the launcher (`outcomes`), and the launcher that ends with the run's own code (`launch`);
- throughput, MFU and memory (`metrics`, the FLOP counts handed in); the profiler and memory
  snapshots (`profiling`), read back afterwards (`recordings`); counting host syncs (`host_syncs`).

It imports nothing outside this folder but what `requirements.txt` beside it pins (torch, numpy,
safetensors, TensorBoard, tqdm; nvidia-ml-py where it is installed), and names no model.
`tests/toy_train.py` is the smallest loop built from it, training the template (each step's
gradient the whole global batch's over micro-batches and ranks, one host sync per step, resume,
preemption), and `tests/test_harness.py` its tests: `python -m pytest harness/tests` from the
folder that holds the copy.
"""
