"""What an evaluation reads of a run's configuration, and how this one runs: shared by the
evaluation and its report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class EvalSettings:
    """What an evaluation reads of a run's configuration, and how this one runs."""

    batch_size: int
    max_new_tokens: int
    text_baselines: bool
    precision: str  # the autocast dtype, and which payload controls differ under it
    seed: int  # the shuffled control's pairing
    num_latents: int  # the text_cut baseline's token budget
    max_prompt_bytes: int  # the collator's cuts and padding, as in training
    max_answer_tokens: int
    pad_multiple: int
    word_patch: int  # the collator's word alignment, as in training (WireConfig.word_patch)
    progress: Callable[[int, int], object] | None = None  # (examples done, of) on this rank, after each chunk
    # Asked before each chunk, on every rank at every chunk position (a collective when distributed):
    # True drops the unfinished evaluation (a preemption signal, heard within one chunk).
    stop: Callable[[], bool] | None = None
    # The LLMs are sharded over the ranks (FSDP): each of their forwards needs every rank, so every
    # rank runs as many chunks (the short ones repeat one, its records dropped) and decodes until
    # all are done.
    lockstep: bool = False

    @classmethod
    def of(
        cls,
        config,
        *,
        text_baselines: bool,
        batch_size: int | None = None,
        max_new_tokens: int | None = None,
        progress=None,
        lockstep: bool = False,
        stop=None,
    ) -> EvalSettings:
        """From a run's configuration; batch size and generation limit default to the run's."""
        data = config.data
        return cls(
            batch_size=batch_size or config.training.micro_batch_size,
            max_new_tokens=max_new_tokens or config.evaluation.max_new_tokens,
            text_baselines=text_baselines,
            precision=config.numerics.precision,
            seed=config.training.seed,
            num_latents=config.wire.num_latents,
            max_prompt_bytes=data.max_prompt_bytes,
            max_answer_tokens=data.max_answer_tokens,
            pad_multiple=data.pad_multiple,
            word_patch=config.wire.word_patch,
            progress=progress,
            lockstep=lockstep,
            stop=stop,
        )
