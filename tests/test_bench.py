"""Each bench/ script runs end to end with --quick and ends in the contract's summary line.

The ratios are timings on a shared machine, so only their form is checked, never their value.
"""
import math
import re
import subprocess
import sys

import pytest

from conftest import REPO, child_env, ok

# The last whitespace-separated field of the last line is `ratio=<number>`.
RATIO = re.compile(r"(?:^|\s)ratio=(\S+)$")


@pytest.mark.slow
@pytest.mark.parametrize("script", ["loop_overhead", "dataloader", "compile", "ddp_scaling"])
def test_quick_run_ends_in_a_ratio(script):
    proc = ok(subprocess.run([sys.executable, str(REPO / "bench" / f"{script}.py"), "--quick"], cwd=REPO,
                             env=child_env(), capture_output=True, text=True, timeout=600))
    last = proc.stdout.strip().splitlines()[-1]
    match = RATIO.search(last)
    assert match, f"last line has no ratio=<number> field: {last!r}"
    ratio = float(match.group(1))
    assert math.isfinite(ratio) and ratio > 0, last
