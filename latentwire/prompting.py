"""One prompt contract for every path that puts a prompt before an answer: the wire in training,
the text-reading teacher of distillation, and evaluation's wire and text inputs.

    lead ; middle ; tail ; answer ; EOS

The middle is the wire's M soft tokens or the prompt's own tokens; nothing else differs. The lead
is what the tokenizer starts any text with (Llama's BOS; nothing for Qwen, which has none). The tail
is the anchor text, the cue that an answer follows: the same after a wire as after a text prompt,
so what the LLM learned to do after it while reading text is what the wire is trained to trigger.
The default, "\\nanswer:", is the format the tiny readers were pretrained on. With the chat template
(for instruct models), the middle is the user's turn: the lead is everything the template puts
before the user's content, the tail everything after it up to the assistant's turn, then the anchor.

LatentWire's authors list the traps this closes: a BOS or an anchor present in training and absent
in evaluation (or the reverse) leaves the wire trained for a context it never meets.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .errors import UserError

DEFAULT_ANCHOR = "\nanswer:"
# Stands for the middle while the chat template is rendered; cut out of the text afterwards.
MIDDLE = "\u241fLATENTWIRE_PROMPT\u241f"


@dataclass(frozen=True)
class PromptFormat:
    """The run's choice: the anchor text and whether to wrap the middle in the chat template."""
    anchor: str = DEFAULT_ANCHOR
    chat_template: bool = False
    FLAT_NAMES: ClassVar[dict] = {"anchor": "anchor_text"}


@dataclass(frozen=True)
class PromptContract:
    """One tokenizer's token ids before and after the middle."""
    lead: tuple[int, ...]
    tail: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer, prompt: PromptFormat = PromptFormat(), who: str = "the") -> PromptContract:
        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else ()

        if not prompt.chat_template:
            bos = tokenizer.bos_token_id
            return cls(() if bos is None else (bos,), ids(prompt.anchor))
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"--chat-template true: {who} tokenizer has no chat template")
        text = tokenizer.apply_chat_template([{"role": "user", "content": MIDDLE}], tokenize=False,
                                             add_generation_prompt=True)
        before, _, after = text.partition(MIDDLE)
        # The template writes its own BOS as text, which the tokenizer reads back as the special token.
        return cls(ids(before), ids(after + prompt.anchor))

    def around(self, middle: list[int]) -> list[int]:
        """A text prompt's row: lead, the prompt's tokens, tail."""
        return [*self.lead, *middle, *self.tail]
