"""Byte-level BPE tokenizer for the reference models, trained with `tokenizers` on the train split.

Byte-level pre-tokenization without an added prefix space and a byte-level decoder make ``decode(encode(text))``
return ``text`` exactly for any string. One special token, ``<|endoftext|>``, is bos, eos and pad: it separates
files when the corpus is packed into training sequences. The tokenizer is wrapped in ``PreTrainedTokenizerFast`` so
``save_pretrained`` writes the standard ``tokenizer.json`` that ``AutoTokenizer.from_pretrained(folder)`` loads.

Chat template (``CHAT_TEMPLATE``, used by ``apply_chat_template`` and the server's chat endpoint): each message is a
role tag line ``<|role|>`` followed by its content and ``<|endoftext|>`` (the end of a turn is the eos token, so
generation stops there), then a newline; ``add_generation_prompt`` appends ``<|assistant|>`` and a newline. The
tags are plain text, so the template adds no tokens to the vocabulary::

    <|system|>\nYou write Python.<|endoftext|>\n<|user|>\nSort a list.<|endoftext|>\n<|assistant|>\n

Tools (``apply_chat_template(tools=...)``) are listed, one JSON object per line, in a first system turn that says how
to call them; an assistant message's ``tool_calls`` follow its content as ``<tool_call>{"name", "arguments"}
</tool_call>`` (Hermes' form), which ``RESPONSE_TEMPLATE`` (the tokenizer's ``response_template``) parses back.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 4096
MIN_VOCAB_SIZE = 256 + 1  # every byte plus the special token
CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>\nYou can call these functions. To call one, write <tool_call>{\"name\": NAME, "
    "\"arguments\": {...}}</tool_call>.\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}" + END_OF_TEXT + "\n"
    "{% endif %}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>{{ {'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson }}</tool_call>{% endfor %}" + END_OF_TEXT + "\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# transformers' declarative reply parser (`tokenizer.parse_response`): text, then `<tool_call>{json}</tool_call>`s
RESPONSE_TEMPLATE = {
    "start_anchor": "<|assistant|>\n",
    "fields": {
        "content": {"content": "text"},
        "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True,
                       "transform": {"type": "function", "function": {"name": "{content.name}",
                                                                      "arguments": "{content.arguments}"}}},
    },
}


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` (deterministic for the same texts in the same order).

    ``vocab_size`` counts the 256 byte tokens and ``<|endoftext|>`` (id 0); the result may be smaller when the
    texts allow fewer merges.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return wrap_tokenizer(backend)


def wrap_tokenizer(backend: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer around a trained backend, with ``<|endoftext|>`` as bos, eos and pad."""
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
        chat_template=CHAT_TEMPLATE,
        response_template=RESPONSE_TEMPLATE,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: Path) -> Path:
    """Write ``tokenizer.json`` and its config into ``folder`` (created if needed); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    return folder
