"""What the Engine accepts as a prompt: a string (encoded with the engine's tokenizer) or a list of token ids."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

Prompt = str | list[int]


def is_token_ids(value: object) -> bool:
    """A non-empty list or tuple of ints (bools excluded)."""
    if not isinstance(value, (list, tuple)) or not value:
        return False
    return all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt as a list of one; several as a list."""
    return [prompts] if isinstance(prompts, str) or is_token_ids(prompts) else list(prompts)


def encode_prompt(tokenizer: PreTrainedTokenizerBase | None, prompt: Prompt) -> tuple[str | None, list[int]]:
    """`(text, token ids)` of `prompt`; text is None for a token-id prompt. Raises ValueError for a string without a
    tokenizer and TypeError for anything else."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("`prompt` is a string but the Engine has no tokenizer; pass token ids or a tokenizer")
        return prompt, tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if is_token_ids(prompt):
        return None, list(prompt)
    raise TypeError(f"`prompt` must be a string or a list of token ids, got {type(prompt).__name__}")
