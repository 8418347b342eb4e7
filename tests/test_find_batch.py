"""find_batch: the search, the measured CPU probe against a cap, out-of-memory handling, agreement
across ranks, and the command line."""

import gc
import json

import pytest
import torch

from conftest import assert_one_line_error, ok, run_module
from latentwire.find_batch import Probe, Trial, fit_trials, run_trial, search
from latentwire.model import WireEncoder
from latentwire.planner.script import script_step
from latentwire.settings import load_config

CPU = torch.device("cpu")
STEP = script_step()  # train.py's, as the command measures it
# Short prompts and answers keep each real trial well under a second.
SMALL = ["--max-prompt-bytes", "96", "--pad-multiple", "32", "--max-answer-tokens", "4"]


def fits_up_to(limit: int):
    return lambda m: Trial(m, m <= limit, m if m <= limit else None, None, 0.0, "" if m <= limit else "too big")


@pytest.mark.parametrize("limit", [1, 2, 7, 16, 37, 64, 1000])
@pytest.mark.parametrize("start", [1, 16, 50])
def test_search_finds_the_limit_of_a_monotone_probe(limit, start):
    best, trials = search(fits_up_to(limit), start)
    assert best == limit
    tried = {t.micro_batch: t.fits for t in trials}
    assert tried[limit] and not tried[limit + 1]  # the answer is pinned by a fit and a failure
    assert len(trials) <= 2 * (limit + start).bit_length() + 2


def test_search_stops_growing_at_the_limit_and_reports_nothing_fits():
    best, trials = search(fits_up_to(100), 4, limit=10)
    assert best == 10 and max(t.micro_batch for t in trials) == 10
    assert search(fits_up_to(0), 8)[0] == 0


def test_search_finds_the_true_limit_against_the_measured_cpu_probe(llms):
    """The cap sits between the measured peaks of micro-batches 5 and 6: the limit is 5."""
    cfg = load_config(["--profile", "cpu", *SMALL])
    uncapped = Probe(cfg, llms, STEP, CPU, steps=3, cap_bytes=2**62)
    peak5, peak6 = uncapped(5)[0], uncapped(6)[0]
    assert peak5 < peak6
    probe = Probe(cfg, llms, STEP, CPU, steps=3, cap_bytes=(peak5 + peak6) // 2)
    best, trials = search(lambda m: run_trial(probe, m, CPU), start=2)
    assert best == 5
    by_size = {t.micro_batch: t for t in trials}
    assert by_size[5].fits and by_size[5].peak_allocated == peak5  # the measure is the same on every run
    assert not by_size[6].fits and "over the cap" in by_size[6].error and by_size[6].peak_allocated == peak6
    assert all(t.fits == (t.micro_batch <= 5) for t in trials)
    fit = fit_trials(trials)
    assert fit.r2 > 0.99 and fit.per_sample > 0


def test_a_real_allocation_failure_is_caught_freed_and_the_search_goes_on(llms):
    cfg = load_config(["--profile", "cpu", *SMALL])
    probe = Probe(cfg, llms, STEP, CPU, steps=1, cap_bytes=2**62)
    huge = run_trial(probe, 2**40, CPU)  # the model is built, then the CPU allocator refuses 2^40 prompts
    assert not huge.fits and "can't allocate memory" in huge.error and huge.peak_allocated is None
    assert not [o for o in gc.get_objects() if type(o) is WireEncoder]  # the failed trial's model is gone
    after = run_trial(probe, 2, CPU)
    assert after.fits and after.peak_allocated > 0


def _agree(rank: int, world: int, init_file: str, results) -> None:
    import torch.distributed as dist

    from latentwire.find_batch import all_ranks_fit

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results[rank] = (all_ranks_fit(rank == 0, CPU), all_ranks_fit(True, CPU))
    finally:
        dist.destroy_process_group()


def test_ranks_agree_that_a_trial_fits_only_if_it_fits_everywhere(tmp_path):
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_agree, args=(2, str(tmp_path / "init"), results), nprocs=2)
        assert dict(results) == {0: (False, True), 1: (False, True)}


@pytest.mark.slow
def test_find_batch_command_writes_json_and_a_tensorboard_plot(tmp_path):
    out = tmp_path / "run"
    # The cpu profile at these sizes holds about 8 MiB and 2 MiB per sample: a cap that fits a few.
    proc = ok(
        run_module(
            "latentwire.find_batch",
            ["--profile", "cpu", *SMALL, "--cap-gb", "0.015", "--micro-batch-size", "2", "--out-dir", str(out)],
            elsewhere=tmp_path,
        )
    )  # train.py's step read from the checkout, from any directory
    result = json.loads((out / "find_batch.json").read_text())
    trials = result["trials"]
    best = result["max_micro_batch"]
    assert best >= 2 and {t["micro_batch"] for t in trials} >= {best, best + 1}
    assert all(t["fits"] == (t["micro_batch"] <= best) for t in trials)
    assert all(t["peak_allocated"] <= result["cap_bytes"] for t in trials if t["fits"])
    assert "R^2" in proc.stdout and f"largest micro-batch that fits: {best}" in proc.stdout
    assert list((out / "find_batch_tb").glob("events.out.tfevents.*"))


def test_bad_find_batch_input_is_one_line(forked):
    assert_one_line_error(forked("latentwire.find_batch", ["--profile", "cpu", "--cap-gb", "-1"]), "--cap-gb")
