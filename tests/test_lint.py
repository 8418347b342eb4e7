"""The checkout passes ruff (ruff.toml: pyflakes, pycodestyle at 120 columns, bugbear, import
order), so the README's test command, which CI runs, checks lint too."""
from conftest import ok, run_module


def test_ruff_check_passes():
    # --no-cache: a test writes nothing into the checkout.
    ok(run_module("ruff", ["check", "--no-cache", "."]))
