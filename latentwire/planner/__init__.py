"""The memory planner: which micro-batch fits a card, traced on the CPU before renting it
(`memory_plan`, `memtrace`, `budget`, `analytic`), and elastic batch built on it. A tool above the
library: train.py (--elastic-batch) and `python -m latentwire.plan` / `find_batch` use it, each handing
in train.py's step (`memtrace.TrainingStep`)."""
