"""Compiled grammars for `StructuredOutput` constraints, on xgrammar: one `GrammarCompiler` per tokenizer and
vocabulary size (kept, least recently used first out, `MAX_COMPILERS`), whose own cache keeps compiled grammars by
their text within `CACHE_LIMIT_BYTES`. xgrammar is an optional dependency (the `structured` extra); asking for a
constraint without it raises ImportError naming the extra."""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from typing import Any

from transformers import PreTrainedTokenizerBase

from .constraint import StructuredOutput

MAX_COMPILERS = 8  # tokenizers (with a vocabulary size) whose compiler is kept
CACHE_LIMIT_BYTES = 256 * 1024 * 1024  # compiled grammars each compiler keeps
MAX_PARSED = 256  # constraints remembered as parsed (`parsed`)
_compilers: OrderedDict[tuple, tuple[PreTrainedTokenizerBase, Any]] = OrderedDict()
_lock = threading.Lock()


def xgrammar() -> Any:
    """The xgrammar module; ImportError naming the extra to install when it is missing."""
    try:
        import xgrammar as xgr
    except ImportError as error:
        raise ImportError("structured outputs need xgrammar: pip install 'hf_accel[structured]'") from error
    return xgr


def compiler_for(tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int] | None,
                 max_threads: int = 8) -> Any:
    """The `GrammarCompiler` of `tokenizer` over a model vocabulary of `vocab_size` (its logits' width, which may
    exceed the tokenizer's), whose grammars end on `stop_token_ids` (None: the tokenizer's EOS), compiling on up to
    `max_threads` threads (xgrammar's default 8 for a caller that waits; 1 beside a decoding engine)."""
    xgr = xgrammar()
    key = (id(tokenizer), vocab_size, tuple(stop_token_ids or ()), max_threads)
    with _lock:
        found = _compilers.get(key)
        if found is not None and found[0] is tokenizer:  # an id reused by a new tokenizer is a miss
            _compilers.move_to_end(key)
            return found[1]
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=True,
                                       cache_limit_bytes=CACHE_LIMIT_BYTES)
        _compilers[key] = (tokenizer, compiler)
        while len(_compilers) > MAX_COMPILERS:
            _compilers.popitem(last=False)
        return compiler


def parse_constraint(constraint: StructuredOutput) -> Any:
    """`constraint` as an xgrammar `Grammar` (parsed, not yet compiled against a vocabulary: cheap, no tokenizer);
    ValueError naming the constraint and what the backend refused (an unsupported schema feature, a bad regex or
    grammar). The engine calls it when a request is added, so a bad constraint is refused there."""
    xgr, kind = xgrammar(), constraint.kind
    try:
        if kind == "json":
            return _exact_json_strings(xgr.Grammar.from_json_schema(json.dumps(constraint.schema()),
                                                                    any_whitespace=False))
        if kind == "json_object":  # an object with any members
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(constraint.regex)
        if kind == "choice":  # one EBNF alternative per string, each a quoted literal
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in constraint.choice))
        if kind == "structural_tag":  # its JSON schemas' strings as a `json` constraint's
            return _exact_json_strings(xgr.Grammar.from_structural_tag(constraint.structural_tag_text()))
        return xgr.Grammar.from_ebnf(constraint.grammar)
    except (RuntimeError, ValueError, TypeError) as error:
        raise _refused(kind, error) from error


# xgrammar (0.2.9) writes one character of a string with minLength / maxLength as this class, which admits the raw
# control characters U+0000-U+001F that JSON forbids unescaped (and, as here, no quote or backslash: no escapes).
# An escape as an alternative under the length's repetition made each mask cost ~1.8 ms instead of ~5 us.
_LENGTH_CHARACTER = r'[^\"\\\r\n]'
_JSON_CHARACTER = r'[^\0-\x1f\"\\\r\n]'


def _exact_json_strings(grammar: Any) -> Any:
    """`grammar` (xgrammar's JSON-schema grammar) with no raw control character in a length-limited string: without
    this a model can write one there, and `json.loads` refuses the output."""
    text = str(grammar)
    if _LENGTH_CHARACTER not in text:
        return grammar
    return xgrammar().Grammar.from_ebnf(text.replace(_LENGTH_CHARACTER, _JSON_CHARACTER))


def compile_constraint(constraint: StructuredOutput, compiler: Any) -> Any:
    """`constraint` compiled by `compiler` (an xgrammar `CompiledGrammar`); ValueError as `parse_constraint`."""
    return compile_parsed(constraint.kind, parsed(constraint.key()), compiler)


# One parsed grammar may reach several threads at once (engines' compile workers, generate calls): read-only there,
# since the compilers cache (`compiler_for`: cache_enabled), and xgrammar's caching compile works from its text.
@functools.lru_cache(maxsize=MAX_PARSED)
def parsed(key: tuple[str, str]) -> Any:
    """`parse_constraint` of the constraint whose `StructuredOutput.key()` is `key`, remembered (`MAX_PARSED`): a
    schema sent many times is parsed once (a JSON schema's parse took ~1 ms of each constrained generate call)."""
    kind, text = key
    value = True if kind == "json_object" else json.loads(text) if kind == "choice" else text
    return parse_constraint(StructuredOutput(**{kind: value}))


def compile_parsed(kind: str, grammar: Any, compiler: Any) -> Any:
    """`grammar` (`parse_constraint`'s, of a `kind` constraint) compiled by `compiler`. All of it runs in xgrammar's
    C++ without the GIL, so a worker thread compiling it leaves a decoding thread alone."""
    try:
        return compiler.compile_grammar(grammar)
    except (RuntimeError, ValueError, TypeError) as error:
        raise _refused(kind, error) from error


def _refused(kind: str, error: Exception) -> ValueError:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    reason = re.sub(r"^\[[0-9:]+\] \S+: ", "", reason)  # xgrammar's "[time] file.cc:line: " prefix
    return ValueError(f"the `{kind}` constraint cannot be compiled: {reason}")
