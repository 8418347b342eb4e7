"""hw_profiles.json and the command line: every profile validates, bad input is one clear line."""

import dataclasses
import json
import typing

import pytest

from conftest import assert_one_line_error
from latentwire.harness.config import read_profiles
from latentwire.harness.errors import UserError
from latentwire.settings import DEFAULT_PROFILES, Config, load_config

PROFILES = read_profiles(DEFAULT_PROFILES)
SCHEMA = Config.schema()
FIELDS = SCHEMA.fields  # the loop's and LatentWire's
REQUIRED_KEYS = {"cpu", "h100", "h100x4", "h200", "a100-80gb", "a100-40gb", "rtx6000ada", "v100"}


def test_required_profiles_exist():
    assert REQUIRED_KEYS <= set(PROFILES)


@pytest.mark.parametrize("key", sorted(PROFILES))
def test_every_profile_resolves_with_every_field(key):
    values = SCHEMA.resolve_profile(PROFILES, key, DEFAULT_PROFILES)
    assert set(values) == set(FIELDS)
    for name, value in values.items():
        assert value is None or type(value) is FIELDS[name].kind, name


def test_cards_follow_their_hardware():
    v100, h100, h200 = (SCHEMA.resolve_profile(PROFILES, k, DEFAULT_PROFILES) for k in ("v100", "h100", "h200"))
    assert not v100["supports_bf16"] and v100["precision"] == "fp16"
    assert h100["precision"] == "bf16" and h100["llama"] == "meta-llama/Llama-3.1-8B"
    assert h100["qwen"] == "Qwen/Qwen2.5-7B"
    assert h200["memory_gb"] > h100["memory_gb"] and h200["peak_tflops_bf16"] == h100["peak_tflops_bf16"]
    cpu = SCHEMA.resolve_profile(PROFILES, "cpu", DEFAULT_PROFILES)
    assert cpu["device"] == "cpu" and cpu["peak_tflops_bf16"] is None and cpu["llama"] == "tiny"


def test_extends_overrides_only_what_it_names():
    h100, h100x4 = (SCHEMA.resolve_profile(PROFILES, key, DEFAULT_PROFILES) for key in ("h100", "h100x4"))
    differing = {k for k in FIELDS if h100[k] != h100x4[k]}
    assert differing == set(PROFILES["h100x4"]) - {"extends"}


def broken(tmp_path, mutate) -> str:
    profiles = json.loads(DEFAULT_PROFILES.read_text())
    mutate(profiles)
    path = tmp_path / "hw_profiles.json"
    path.write_text(json.dumps(profiles))
    return str(path)


@pytest.mark.parametrize(
    "mutate, fragments",
    [
        (lambda p: p["cpu"].pop("memory_gb"), ["'cpu'", "missing field 'memory_gb'"]),
        (lambda p: p["cpu"].update(learning_rate=1.0), ["'cpu'", "unknown field 'learning_rate'"]),
        (lambda p: p["cpu"].update(micro_batch_size="8"), ["'cpu'", "'micro_batch_size' must be int"]),
        (lambda p: p["cpu"].update(micro_batch_size=0), ["'micro_batch_size' must be > 0"]),
        (lambda p: p["cpu"].update(precision="fp8"), ["'precision' must be one of bf16, fp16, fp32"]),
        (lambda p: p["cpu"].update(compile="yes"), ["'compile' must be bool"]),
        (lambda p: p["cpu"].update(lr=float("inf")), ["'lr' must be a finite number, got inf"]),  # JSON Infinity
        (lambda p: p["cpu"].update(extends="nowhere"), ["'extends' names unknown profile 'nowhere'"]),
        (lambda p: p["cpu"].update(supports_bf16=False, precision="bf16"), ["bf16 on a card without bf16"]),
    ],
)
def test_broken_profile_names_the_field(tmp_path, mutate, fragments):
    path = broken(tmp_path, mutate)
    with pytest.raises(UserError) as e:
        load_config(["--profile", "cpu", "--hw-profiles", path])
    for fragment in fragments:
        assert fragment in str(e.value)


def test_a_profile_names_its_card_and_what_differs_from_the_defaults(tmp_path):
    """Every setting but the card's name, device and memory has a default; a profile of those three
    alone is the defaults' run (one GPU-free reference: fp32, eager, the tiny offline readers), and
    its out_dir is runs/<key>."""
    path = tmp_path / "hw_profiles.json"
    path.write_text(json.dumps({"mine": {"description": "a laptop", "device": "cpu", "memory_gb": 16}}))
    cfg = load_config(["--profile", "mine", "--hw-profiles", str(path)])
    assert (cfg.numerics.precision, cfg.compile.enabled, cfg.frozen.llama, cfg.data.dataset) == (
        "fp32",
        False,
        "tiny",
        "synthetic",
    )
    assert (cfg.training.num_gpus, cfg.card.peak_tflops_tf32, cfg.output.out_dir) == (1, None, "runs/mine")
    assert sorted(k for k, f in FIELDS.items() if f.default is dataclasses.MISSING) == [
        "description",
        "device",
        "memory_gb",
    ]
    for key, profile in PROFILES.items():  # no profile restates a default or its parent's value
        parent = (
            SCHEMA.resolve_profile(PROFILES, profile["extends"], DEFAULT_PROFILES)
            if "extends" in profile
            else SCHEMA.defaults()
        )
        assert not [k for k, v in profile.items() if k not in ("extends", "description") and parent.get(k) == v], key


def test_every_field_is_one_setting_of_one_section_and_meta_json_keeps_the_flat_names():
    """Each setting, declared once as a section's field, is one profile key and flag, and the flat
    record a checkpoint keeps reads back into the same configuration."""
    for key, field in FIELDS.items():
        section = typing.get_type_hints(Config)[field.section]
        assert field.name in {f.name for f in dataclasses.fields(section)}, key
    cfg = load_config(
        [
            "--profile",
            "cpu",
            "--compile",
            "true",
            "--compile-mode",
            "max-autotune-no-cudagraphs",
            "--adam-beta1",
            "0.8",
            "--anchor-text",
            " A:",
            "--eval-every",
            "7",
            "--profiler",
            "true",
            "--frozen-sharding",
            "fsdp",
        ]
    )
    assert (cfg.compile.enabled, cfg.compile.mode, cfg.optimizer.beta1) == (True, "max-autotune-no-cudagraphs", 0.8)
    assert (cfg.prompt.anchor, cfg.output.eval_every, cfg.profiler.enabled, cfg.frozen.sharding) == (
        " A:",
        7,
        True,
        "fsdp",
    )
    meta = cfg.to_dict()
    assert list(meta) == ["profile", *FIELDS] and meta["compile_mode"] == "max-autotune-no-cudagraphs"
    assert meta["adam_beta1"] == 0.8 and meta["anchor_text"] == " A:" and meta["frozen_sharding"] == "fsdp"
    assert Config.of(cfg.flat(), cfg.invocation) == cfg


def test_inherited_field_errors_name_the_profile(tmp_path):
    path = broken(tmp_path, lambda p: p["h100"].update(lr=-1))
    with pytest.raises(UserError, match="'h200'.*'lr' must be > 0"):
        load_config(["--profile", "h200", "--hw-profiles", path])


def test_flags_override_profile_fields():
    cfg = load_config(
        [
            "--profile",
            "cpu",
            "--micro-batch-size",
            "4",
            "--grad-accum-steps",
            "8",
            "--lr",
            "3e-4",
            "--compile",
            "true",
            "--out-dir",
            "runs/x",
            "--precision",
            "bf16",
            "--dropout",
            "0",
        ]
    )
    assert (cfg.training.micro_batch_size, cfg.training.grad_accum_steps) == (4, 8)
    assert (cfg.optimizer.lr, cfg.compile.enabled) == (3e-4, True)
    assert (cfg.output.out_dir, cfg.numerics.precision, cfg.wire.dropout) == ("runs/x", "bf16", 0.0)


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--micro-batch-size", "0"], "--micro-batch-size: field 'micro_batch_size' must be > 0"),
        (["--micro-batch-size", "-2"], "must be > 0"),
        (["--grad-accum-steps", "0"], "'grad_accum_steps' must be > 0"),
        (["--lr", "0"], "'lr' must be > 0"),
        (["--lr", "fast"], "argument --lr: invalid"),
        (["--lr", "inf"], "--lr: field 'lr' must be a finite number, got inf"),
        (["--max-grad-norm", "nan"], "'max_grad_norm' must be a finite number, got nan"),
        (["--precision", "fp64"], "'precision' must be one of"),
        (["--compile", "maybe"], "expected true or false"),
        (
            ["--encoder-dim", "12", "--encoder-heads", "4", "--d-z", "64"],
            "head width, encoder_dim / encoder_heads = 3, must be even",
        ),
        (["--stop-at-step", "0"], "--stop-at-step must be > 0"),
        (["--max-step", "3"], "unrecognized arguments: --max-step"),  # no prefix matching of --max-steps
        (["--resume", "--overwrite"], "--resume and --overwrite exclude each other"),
        (["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_flag_values(flags, fragment):
    with pytest.raises(UserError, match=fragment.replace("(", r"\(")):
        load_config(["--profile", "cpu", *flags])


def test_bf16_on_v100_is_refused():
    with pytest.raises(UserError, match="bf16 on a card without bf16"):
        load_config(["--profile", "v100", "--precision", "bf16"])


# --- from the outside: exit code, one line, no traceback, nothing written ------------------------


def test_unknown_profile_lists_valid_keys(tmp_path, forked):
    proc = forked("train.py", ["--profile", "h1000", "--out-dir", tmp_path / "run"])
    line = assert_one_line_error(proc, "unknown profile 'h1000'", "valid profiles:")
    assert all(key in line for key in REQUIRED_KEYS)
    assert not (tmp_path / "run").exists()


def test_malformed_json_is_one_line(tmp_path, forked):
    path = tmp_path / "hw_profiles.json"
    path.write_text('{"cpu": {"device": "cpu",}}')
    proc = forked("train.py", ["--profile", "cpu", "--hw-profiles", path])
    assert_one_line_error(proc, "is not valid JSON", "line 1")


def test_bad_field_in_file_is_one_line(tmp_path, forked):
    profiles = broken(tmp_path, lambda p: p["cpu"].update(grad_accum_steps=0))
    proc = forked("train.py", ["--profile", "cpu", "--hw-profiles", profiles])
    assert_one_line_error(proc, "profile 'cpu'", "'grad_accum_steps' must be > 0")


def test_bad_flag_is_one_line(forked):
    assert_one_line_error(forked("train.py", ["--profile", "cpu", "--micro-batch-size", "zero"]), "--micro-batch-size")


def test_help_lists_the_profiles_and_the_values_of_the_one_named():
    from latentwire.settings import build_parser

    text = build_parser(argv=["--profile", "v100"]).format_help()
    for key in json.loads(DEFAULT_PROFILES.read_text()):
        assert f"\n  {key} " in text
    assert "--precision {bf16,fp16,fp32}" in text and "(v100: fp16)" in text and "(v100: false)" in text
    assert "(v100: " not in build_parser(argv=[]).format_help()
