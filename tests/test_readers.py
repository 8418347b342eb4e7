"""The cpu profile's tiny readers read: pretrained here on the synthetic reading-comprehension set,
they answer held-out questions from the text prompt the evaluation feeds them."""

import pytest
import torch
from safetensors.torch import load_file

from conftest import ok, run_module
from latentwire.dataset import synthetic_corpus_text
from latentwire.llm import LLM_NAMES, load_frozen_llm
from latentwire.llm_sources import tiny_tokenizer
from latentwire.readers import HELD_OUT_EXAMPLES, held_out_em

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", LLM_NAMES)
def test_the_shipped_readers_answer_held_out_questions_from_the_text(name):
    """The bar of the issue that shipped them: 80% exact match on 300 held-out examples; the
    randomly initialised readers of the same architecture score about 0."""
    assert HELD_OUT_EXAMPLES == 300
    assert held_out_em(load_frozen_llm(name, "tiny", torch.float32, CPU)) >= 80
    assert held_out_em(load_frozen_llm(name, "tiny-random", torch.float32, CPU), n=50) < 5


@pytest.mark.parametrize("name", LLM_NAMES)
def test_the_shipped_readers_read_with_the_tokenizers_they_were_trained_with(name):
    """Loaded as `tiny`, the Qwen reader keeps its own BPE: wrapped in Qwen2's tokenizer class (what
    AutoTokenizer picks for its directory) numbers split digit by digit and it answers 71%, not 84%."""
    texts = synthetic_corpus_text(200, seed=3)
    shipped = load_frozen_llm(name, "tiny", torch.float32, CPU).tokenizer
    assert shipped(texts)["input_ids"] == tiny_tokenizer(name)(texts)["input_ids"]


def test_the_rebuild_command_is_seeded_and_writes_a_reader_that_loads(tmp_path):
    """Two builds of a few steps give the same bytes, and the directory loads as a model source."""
    for out in ("a", "b"):
        ok(run_module("latentwire.readers", ["--out", str(tmp_path / out), "--steps", "3", "--only", "qwen"]))
    a, b = (load_file(str(tmp_path / out / "qwen" / "model.safetensors")) for out in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    built = load_frozen_llm("qwen", str(tmp_path / "a" / "qwen"), torch.float32, CPU)
    random = load_frozen_llm("qwen", "tiny-random", torch.float32, CPU)
    assert built.tokenizer.get_vocab() == random.tokenizer.get_vocab()
    stepped = [k for k, t in built.model.state_dict().items() if not torch.equal(t, random.model.state_dict()[k])]
    assert stepped  # three optimizer steps from the tiny-random initialisation
