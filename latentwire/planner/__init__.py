"""The memory planner: which micro-batch fits a card, traced on the CPU before renting it
(`memory_plan`, `memtrace`, `budget`, `analytic`), and elastic batch built on it. A tool above the
library: train.py (--elastic-batch, through the recipe) hands it train.py's step
(`harness.recipe.TrainingStep`), and `python -m latentwire.plan` / `find_batch` read that step from
the script beside the package (`script.script_step`)."""
