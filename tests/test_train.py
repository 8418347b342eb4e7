"""train.py end to end: the correctness rules of DESIGN.md, checked from the outside."""
import json
import math

import pytest
import torch

from conftest import EXACT, FAST, final_weights, max_rel_diff, ok, read_metrics, run_train


def train(tmp_path, name, *args, nproc=1):
    out = tmp_path / name
    ok(run_train([*args, "--out-dir", str(out)], nproc=nproc))
    return out


@pytest.mark.slow
def test_gradient_accumulation_and_ddp_are_exact(tmp_path):
    """mbs 8 x 1, mbs 2 x accum 4, and mbs 2 x accum 2 x 2 ranks end with the same weights."""
    common = ["--profile", "cpu", *EXACT, *FAST, "--max-steps", "3"]
    big = train(tmp_path, "mbs8", *common, "--micro-batch-size", "8", "--grad-accum-steps", "1")
    accum = train(tmp_path, "accum4", *common, "--micro-batch-size", "2", "--grad-accum-steps", "4")
    ddp = train(tmp_path, "ddp2", *common, "--micro-batch-size", "2", "--grad-accum-steps", "2", nproc=2)
    reference = final_weights(big)
    assert max_rel_diff(reference, final_weights(accum)) < 1e-4
    assert max_rel_diff(reference, final_weights(ddp)) < 1e-4
    # The same global batches, so the same logged losses (of the global batch, not the last
    # micro-batch) and the same pre-clip gradient norms: Adam is blind to a uniformly mis-scaled
    # gradient, the norm is not.
    for other in (accum, ddp):
        for a, b in zip(read_metrics(big), read_metrics(other), strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    # ... and training moved the weights: the comparison is not between untouched inits.
    untouched = train(tmp_path, "lr_tiny", *common, "--micro-batch-size", "8", "--lr", "1e-12")
    assert max_rel_diff(reference, final_weights(untouched)) > 1e-3
