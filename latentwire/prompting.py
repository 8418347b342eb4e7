"""One prompt contract for every path that puts a prompt before an answer: the wire in training,
the text-reading teacher of distillation, and evaluation's wire and text inputs.

    lead ; middle ; tail ; answer ; EOS

The middle is the wire's M soft tokens or the prompt's own tokens; nothing else differs. Each
reader gets the contract it was trained to read:
- a base model (its tokenizer has no chat template): the lead is what the tokenizer starts any
  text with (Llama's BOS; nothing for Qwen, which has none), the tail the anchor text, the cue that
  an answer follows. The default, "\\nanswer:", is the format the tiny readers were pretrained on.
- an instruct model (its tokenizer ships a chat template): the middle is the user's turn, followed
  by an instruction asking for the short answer (LatentWire's authors prompted their readers the
  same way); the lead is everything the template puts before the user's content, the tail the
  instruction, the end of the user's turn and the opening of the assistant's, then the anchor.
  Asked with no instruction, an instruct model answers in sentences ("Leila plays cricket.").
`--chat-template auto` (the default) gives each reader its own: a Llama with a template beside a
Qwen without one reads chat, the Qwen the bare anchor. `true` requires both to have one, `false`
gives both the bare anchor (a base model whose tokenizer ships a template anyway).

The tail is the same after a wire as after a text prompt, so what the LLM does after it while
reading text is what the wire is trained to trigger. LatentWire's authors list the traps this
closes: a BOS or an anchor present in training and absent in evaluation (or the reverse) leaves
the wire trained for a context it never meets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .harness.config import setting
from .harness.errors import UserError

DEFAULT_ANCHOR = "\nanswer:"
# Of the instructions tried on SmolLM2-135M-Instruct (docs/evaluation.md), the one whose answers
# scored best; a larger instruct model follows any of them.
DEFAULT_INSTRUCTION = "Answer the question with one or two words."
# What the memory plan allows for a chat template's own tokens around a user turn, before it has
# the tokenizer: Llama-3.1's and Qwen2.5's put 30-odd there with their default system prompts.
CHAT_FRAMING_TOKENS = 64
# Stands for the middle while the chat template is rendered; cut out of the text afterwards.
MIDDLE = "\u241fLATENTWIRE_PROMPT\u241f"


@dataclass(frozen=True)
class PromptFormat:
    """The run's choice: the anchor text, when to wrap the middle in a reader's chat template
    (auto, true or false) and the instruction that follows the middle inside it."""

    anchor: str = setting(
        DEFAULT_ANCHOR,
        "text after the wire and after a text prompt, before the answer (training, "
        "teacher and evaluation alike; '' for none)",
        key="anchor_text",
    )
    chat_template: Literal["auto", "true", "false"] = setting(
        "auto",
        "wrap the wire and text prompts in a reader's chat template: auto (each reader whose tokenizer has "
        "one: instruct models), true (both, or an error), false (neither)",
    )
    instruction: str = setting(
        DEFAULT_INSTRUCTION,
        "inside a chat template, after the prompt: the instruction asking for the short answer ('' for none)",
        key="answer_instruction",
    )


def uses_chat_template(choice: str, has_template: bool, who: str = "the") -> bool:
    """Whether a reader whose tokenizer has (or lacks) a chat template reads chat, under the run's
    --chat-template `choice`; `true` for a reader without one is the user's error."""
    if choice == "true" and not has_template:
        raise UserError(
            f"--chat-template true: {who} tokenizer has no chat template "
            "(--chat-template auto wraps only the readers that have one)"
        )
    return choice == "true" or (choice == "auto" and has_template)


def user_turn(instruction: str) -> str:
    """The user's content around the middle: the instruction follows the prompt."""
    return f"{MIDDLE}\n\n{instruction}" if instruction else MIDDLE


def own_tail_text(prompt: PromptFormat) -> str:
    """Inside a chat template, the tail's text that is not the template's own: the instruction and the anchor."""
    return user_turn(prompt.instruction).partition(MIDDLE)[2] + prompt.anchor


@dataclass(frozen=True)
class PromptContract:
    """One tokenizer's token ids before and after the middle, and whether its chat template frames them."""

    lead: tuple[int, ...]
    tail: tuple[int, ...]
    chat: bool = False

    @classmethod
    def of(cls, tokenizer, prompt: PromptFormat = PromptFormat(), who: str = "the") -> PromptContract:
        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else ()

        if not uses_chat_template(prompt.chat_template, bool(getattr(tokenizer, "chat_template", None)), who):
            bos = tokenizer.bos_token_id
            return cls(() if bos is None else (bos,), ids(prompt.anchor))
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user_turn(prompt.instruction)}], tokenize=False, add_generation_prompt=True
        )
        before, _, after = text.partition(MIDDLE)
        # The template writes its own BOS as text, which the tokenizer reads back as the special token.
        return cls(ids(before), ids(after + prompt.anchor), chat=True)

    def around(self, middle: list[int]) -> list[int]:
        """A text prompt's row: lead, the prompt's tokens, tail."""
        return [*self.lead, *middle, *self.tail]

    def describe(self) -> str:
        """What the opening line says of this reader's contract."""
        kind = "its chat template" if self.chat else "no chat template"
        return f"{kind}, {len(self.lead)} + {len(self.tail)} tokens around the prompt"
