"""The checkout passes ruff (ruff.toml: pyflakes, pycodestyle at 120 columns, bugbear, import
order) and is formatted as `ruff format` writes it, so the README's test command, which CI runs,
checks both."""

from conftest import ok, run_module


def test_ruff_check_passes():
    # --no-cache: a test writes nothing into the checkout.
    ok(run_module("ruff", ["check", "--no-cache", "."]))


def test_ruff_format_would_change_nothing():
    ok(run_module("ruff", ["format", "--check", "--no-cache", "."]))
