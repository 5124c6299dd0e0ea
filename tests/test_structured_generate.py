"""`model.generate(..., structured_output=hf_accel.StructuredOutput(...), tokenizer=tokenizer)`: the output matches
its constraint (JSON schema, Pydantic model, any JSON object, regex, choice, EBNF grammar) on the reference target,
greedy and sampled, left-padded batches, hf_accel's paged cache eager and compiled (the compiled greedy loop masks
inside its step with the bitmask the host filled: the same tokens as eager); bad calls get a clear error naming what
is wrong."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import jsonschema
import pydantic
import pytest
import torch
from transformers import CompileConfig, LogitsProcessor, LogitsProcessorList

import hf_accel
from hf_accel import StructuredOutput, reference
from hf_accel.speculative import ngram
from hf_accel.structured.grammars import xgrammar

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "color": {"enum": ["red", "green", "blue"]},
                                           "done": {"type": "boolean"}},
          "required": ["name", "color", "done"], "additionalProperties": False}
MAX_NEW = 48


class Pet(pydantic.BaseModel):
    kind: str = pydantic.Field(max_length=10)
    legs: int = pydantic.Field(ge=0, le=8)


@pytest.fixture(scope="module")
def pair():
    return reference.load("target")


def generate(pair, prompts: list[str], constraint: StructuredOutput, **kwargs) -> list[str]:
    """The constrained continuations of `prompts` (left-padded batch), EOS cut off, and whether each row stopped."""
    model, tokenizer = pair
    tokenizer.padding_side = "left"
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=MAX_NEW, structured_output=constraint, tokenizer=tokenizer,
                         pad_token_id=tokenizer.pad_token_id, **kwargs)
    texts = []
    for row in out[:, inputs["input_ids"].shape[1]:].tolist():
        eos = model.generation_config.eos_token_id
        stopped = eos in row
        texts.append((tokenizer.decode(row[: row.index(eos)] if stopped else row), stopped))
    return texts


def test_json_schema_greedy_output_validates_and_stops(pair):
    [(text, stopped)] = generate(pair, ["# a config record\nrecord = "], StructuredOutput(json=SCHEMA),
                                 do_sample=False)
    assert stopped, text  # the grammar completed and only EOS was allowed after it
    jsonschema.validate(json.loads(text), SCHEMA)


def test_pydantic_model_and_sampled_batches_validate(pair):
    prompts = ["pet = ", "# the data of one animal\nanimal = "]
    for seed in (0, 1):
        torch.manual_seed(seed)
        for text, stopped in generate(pair, prompts, StructuredOutput(json=Pet), do_sample=True, temperature=1.0):
            assert stopped, text
            Pet.model_validate_json(text)


class _Favour(LogitsProcessor):
    """Adds `bias` to the logits of `token_ids`: a model that wants to write them."""

    def __init__(self, token_ids: list[int], bias: float) -> None:
        self.token_ids, self.bias = token_ids, bias

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores[:, self.token_ids] += self.bias
        return scores


def test_length_limited_json_strings_hold_no_raw_control_characters(pair):
    # xgrammar's own rule for a string with minLength / maxLength admits U+0000-U+001F; a model that favours those
    # tokens (as the random-weight 185M Llama of bench_structured.py did) must still write JSON that parses
    model, tokenizer = pair
    controls = [i for i in range(len(tokenizer)) if any(ord(c) < 0x20 for c in tokenizer.decode([i]))]
    assert controls
    schema = {"type": "object", "properties": {"title": {"type": "string", "minLength": 2, "maxLength": 6},
                                                "tags": {"type": "array", "maxItems": 2,
                                                         "items": {"type": "string", "maxLength": 3}}},
              "required": ["title", "tags"], "additionalProperties": False}
    for bias in (2.0, 50.0):  # xgrammar's rule alone: the output does not parse
        [(text, stopped)] = generate(pair, ["# a note\nnote = "], StructuredOutput(json=schema), do_sample=False,
                                     logits_processor=LogitsProcessorList([_Favour(controls, bias)]))
        assert stopped, text
        jsonschema.validate(json.loads(text), schema)  # parses: no raw control character


def test_regex_choice_grammar_and_json_object(pair):
    [(code, stopped)] = generate(pair, ["code = '"], StructuredOutput(regex=r"[a-z]{3}-[0-9]{2}"), do_sample=False)
    assert stopped and re.fullmatch(r"[a-z]{3}-[0-9]{2}", code)
    choices = ["import os", "import sys", "pass"]
    texts = generate(pair, ["def main():\n    ", "x = 1\n"], StructuredOutput(choice=choices), do_sample=False)
    assert all(stopped and text in choices for text, stopped in texts)
    grammar = 'root ::= "(" number ("," number)* ")"\nnumber ::= [1-9] [0-9]*'
    [(numbers, stopped)] = generate(pair, ["point = "], StructuredOutput(grammar=grammar), do_sample=False)
    assert stopped and re.fullmatch(r"\([1-9][0-9]*(,[1-9][0-9]*)*\)", numbers)
    [(obj, stopped)] = generate(pair, ["data = "], StructuredOutput(json_object=True), do_sample=False)
    assert stopped and isinstance(json.loads(obj), dict)  # an object, not any JSON value


def test_structural_tag_constrains_only_what_its_triggers_open(pair):
    """A structural tag (vLLM's `structural_tag`): the text stays free, but each `(` the model writes opens an integer
    argument closed by `)`; without the tag the same prompt writes other arguments (the test can fail)."""
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["("], "tags": [
        {"begin": "(", "content": {"type": "json_schema", "json_schema": {"type": "integer"}}, "end": ")"}]}}
    prompts = ["def main():\n    print", "for i in range"]
    constrained = generate(pair, prompts, StructuredOutput(structural_tag=tag), do_sample=False)
    free = generate(pair, prompts, StructuredOutput(regex=r"(.|\n)*"), do_sample=False)
    assert all("(" in text for text, _ in constrained) and constrained != free
    for text, stopped in constrained:
        calls = re.findall(r"\(([^)]*)\)?", text)
        complete = calls if text.rstrip().endswith(")") or stopped else calls[:-1]  # the last may be cut short
        assert complete and all(re.fullmatch(r"-?(0|[1-9][0-9]*)", call) for call in complete), text
    with pytest.raises(ValueError, match="structural_tag"):
        generate(pair, prompts[:1], StructuredOutput(structural_tag={"type": "structural_tag", "format": {}}))


def test_paged_cache_compiled_equals_eager(pair):
    constraint = StructuredOutput(json=SCHEMA)
    prompts = ["record = ", "# settings\nconfig = "]
    eager = generate(pair, prompts, constraint, do_sample=False, cache_implementation="paged")
    compiled = generate(pair, prompts, constraint, do_sample=False, cache_implementation="paged",
                        compile_config=CompileConfig(fullgraph=True))
    assert compiled == eager == generate(pair, prompts, constraint, do_sample=False)  # DynamicCache's too
    for text, stopped in compiled:
        assert stopped
        jsonschema.validate(json.loads(text), SCHEMA)


def test_the_step_masks_as_the_host_kernel_does():
    """`token_choice.masked` (in the compiled step) reads xgrammar's bit order and leaves logits past the bitmask's
    words alone, as the host's `apply_bitmask` does."""
    from hf_accel.compiled.token_choice import masked
    from hf_accel.structured.matcher import apply_bitmask

    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 70, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 2), generator=gen, dtype=torch.int64).to(torch.int32)
    host = scores.clone()
    apply_bitmask(host, bitmask)
    assert torch.equal(masked(scores, bitmask), host) and torch.isinf(host[:, :64]).any()
    assert torch.equal(host[:, 64:], scores[:, 64:])


def test_compiled_greedy_masks_inside_its_step(pair, monkeypatch):
    """Greedy compiled generate fills each row's bitmask on the host and masks + chooses in the graph: the host applies
    the processor once (the prefill's token); sampling keeps the host path, one call a token."""
    from hf_accel.structured.logits import StructuredLogitsProcessor

    calls = []
    host_call = StructuredLogitsProcessor.ragged_call
    monkeypatch.setattr(StructuredLogitsProcessor, "ragged_call",
                        lambda self, *args: calls.append(1) or host_call(self, *args))
    constraint = StructuredOutput(json=SCHEMA)
    prompts = ["record = ", "# settings\nconfig = "]
    compiled = generate(pair, prompts, constraint, do_sample=False, cache_implementation="paged",
                        compile_config=CompileConfig(fullgraph=True))
    assert len(calls) == 1
    assert compiled == generate(pair, prompts, constraint, do_sample=False)
    calls.clear()
    torch.manual_seed(0)
    for text, stopped in generate(pair, prompts, constraint, do_sample=True, cache_implementation="paged",
                                  compile_config=CompileConfig(fullgraph=True)):
        if stopped:
            jsonschema.validate(json.loads(text), SCHEMA)
    assert len(calls) > 1


def test_the_appended_token_path_masks_as_following_the_whole_output(pair):
    """`allowed(..., appended=True)` (compiled generate's loop: one token more per row each call) reads only the
    last column and gives the bitmask that following each row's whole output gives: a row choosing allowed tokens
    until its stop (then padded), and a row that writes a token its grammar refuses (then anything)."""
    from hf_accel.structured.grammars import compile_constraint, compiler_for
    from hf_accel.structured.logits import StructuredLogitsProcessor

    model, tokenizer = pair
    eos = model.generation_config.eos_token_id
    compiled = compile_constraint(StructuredOutput(choice=["import os", "pass"]),
                                  compiler_for(tokenizer, model.config.vocab_size, [eos]))
    fast, full = StructuredLogitsProcessor(compiled), StructuredLogitsProcessor(compiled)
    refused = tokenizer.encode("zzz", add_special_tokens=False)[0]
    sequences = torch.tensor(tokenizer(["x = ", "y = "], add_special_tokens=False)["input_ids"])
    bitmask = full.allowed(sequences)
    fast.allowed(sequences)
    rereads = []  # row 0 never re-reads its output: it takes each appended token alone
    follow = fast.matchers[0].follow
    fast.matchers[0].follow = lambda tokens: rereads.append(tokens) or follow(tokens)
    for step in range(12):  # "import os" or "pass", a token at a time at worst, its stop, pads
        bits = ((bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(2, -1)
        first = [int(bits[row].nonzero()[0]) for row in range(2)]  # each row's first allowed token
        chosen = [tokenizer.pad_token_id if bits[0].all() else first[0], refused if step == 1 else first[1]]
        sequences = torch.cat([sequences, torch.tensor(chosen)[:, None]], dim=1)
        bitmask = full.allowed(sequences).clone()
        assert torch.equal(fast.allowed(sequences, appended=True), bitmask)
    assert fast.matchers[0].is_terminated and (bitmask[1] == -1).all()  # a stop reached; a refused row: anything
    assert rereads == []


SPECULATIVE = ["ngram", "draft", "eagle", "medusa"]


def speculative_kwargs(pair, method: str, stats: hf_accel.SpeculativeStats) -> dict:
    model, _ = pair
    if method == "ngram":
        return {"custom_generate": hf_accel.ngram_generate, "ngram_stats": stats}
    if method == "draft":
        return {"custom_generate": hf_accel.draft_generate, "draft_model": reference.load("draft")[0],
                "draft_stats": stats}
    if method == "eagle":
        return {"custom_generate": hf_accel.eagle_generate, "eagle_head": reference.load_head("eagle", model),
                "eagle_stats": stats}
    return {"custom_generate": hf_accel.medusa_generate, "medusa_heads": reference.load_head("medusa"),
            "medusa_stats": stats}


@pytest.mark.parametrize("method", SPECULATIVE)
def test_speculative_decoding_under_a_grammar_equals_constrained_plain_decoding(pair, method):
    """Candidates are scored with the grammar's mask at every position (the processor follows each row's tokens and
    rolls back rejected ones), so greedy output is constrained plain decoding's, batched and ragged."""
    prompts = ["# a config record\nrecord = ", 'config = {"name": "x"}\nother = ']
    for constraint in (StructuredOutput(json=SCHEMA), StructuredOutput(regex=r"[a-z]{3}-[0-9]{2}"),
                       StructuredOutput(choice=["import os", "pass"])):
        stats = hf_accel.SpeculativeStats()
        plain = generate(pair, prompts, dataclasses.replace(constraint, jump_forward=False), do_sample=False)
        assert generate(pair, prompts, constraint, do_sample=False, **speculative_kwargs(pair, method, stats)) == plain
        assert stats.num_target_forwards > 0 and sum(stats.proposed) > 0


def test_a_schema_is_parsed_once_across_calls(pair, monkeypatch):
    from hf_accel.structured import grammars

    parsed = []
    parse = grammars.parse_constraint
    monkeypatch.setattr(grammars, "parse_constraint", lambda constraint: parsed.append(constraint) or parse(constraint))
    constraint = StructuredOutput(json={**SCHEMA, "title": "parsed once in generate"})
    first = generate(pair, ["record = "], constraint, do_sample=False)
    assert generate(pair, ["record = "], constraint, do_sample=False) == first and len(parsed) == 1


def test_a_rounds_positions_are_masked_at_once_with_the_same_tokens(pair, monkeypatch):
    """A greedy speculative call whose only processor is the grammar masks all of a round's positions in one call
    (`mask_candidates`), with the tokens the per-position masks give."""
    from hf_accel.structured.logits import StructuredLogitsProcessor

    prompts = ["# a config record\nrecord = ", 'config = {"name": "x"}\nother = ']
    constraint = StructuredOutput(json=SCHEMA)
    per_position = StructuredLogitsProcessor.mask_candidates
    monkeypatch.setattr("hf_accel.speculative.decoding.TokenRules.grammar_only", lambda rules: None)  # per position
    slow = generate(pair, prompts, constraint, do_sample=False, custom_generate=hf_accel.ngram_generate)
    monkeypatch.undo()
    calls = []
    monkeypatch.setattr(StructuredLogitsProcessor, "mask_candidates",
                        lambda self, *args: calls.append(1) or per_position(self, *args))
    assert generate(pair, prompts, constraint, do_sample=False, custom_generate=hf_accel.ngram_generate) == slow
    assert calls


@pytest.mark.parametrize("assistance", [{"prompt_lookup_num_tokens": 3}, "assistant_model"])
def test_transformers_assisted_decoding_under_a_grammar(pair, assistance):
    if assistance == "assistant_model":
        assistance = {"assistant_model": reference.load("draft")[0]}
    for prompt in ["# a config record\nrecord = ", "pet = "]:
        for constraint in (StructuredOutput(json=SCHEMA), StructuredOutput(json=Pet)):
            plain = generate(pair, [prompt], dataclasses.replace(constraint, jump_forward=False), do_sample=False)
            assert generate(pair, [prompt], constraint, do_sample=False, **assistance) == plain


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_speculative_outputs_validate(pair, method):
    torch.manual_seed(0)
    stats = hf_accel.SpeculativeStats()
    texts = generate(pair, ["pet = ", "# the data of one animal\nanimal = "], StructuredOutput(json=Pet),
                     do_sample=True, temperature=1.0, **speculative_kwargs(pair, method, stats))
    for text, stopped in texts:
        assert stopped, text
        Pet.model_validate_json(text)


def test_bad_calls_name_what_is_wrong(pair):
    model, tokenizer = pair
    ids = tokenizer("x = ", return_tensors="pt")["input_ids"]
    constraint = StructuredOutput(choice=["a", "b"])
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        model.generate(ids, max_new_tokens=4, structured_output=constraint)
    with pytest.raises(ValueError, match="not beam search"):
        model.generate(ids, max_new_tokens=4, structured_output=constraint, tokenizer=tokenizer, num_beams=2)
    with pytest.raises(TypeError, match="must be a hf_accel.StructuredOutput"):
        model.generate(ids, max_new_tokens=4, structured_output={"choice": ["a"]}, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="the `regex` constraint cannot be compiled"):
        model.generate(ids, max_new_tokens=4, structured_output=StructuredOutput(regex="([a-z"), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="the `grammar` constraint cannot be compiled"):
        model.generate(ids, max_new_tokens=4, structured_output=StructuredOutput(grammar="root ::= undefined_rule"),
                       tokenizer=tokenizer)


def test_constraint_arguments_are_checked():
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, choice, grammar, structural_tag; "
                                         "got json, regex"):
        StructuredOutput(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="got none"):
        StructuredOutput()
    with pytest.raises(TypeError, match="`choice` must be a non-empty list"):
        StructuredOutput(choice="abc")
    with pytest.raises(TypeError, match="`json` must be a JSON schema"):
        StructuredOutput(json=3)
    with pytest.raises(ValueError, match="`json` is not valid JSON"):
        StructuredOutput(json="{not json").key()
    assert StructuredOutput(json=Pet).key() == ("json", json.dumps(Pet.model_json_schema()))
    assert StructuredOutput(json=json.dumps(SCHEMA)).key() == StructuredOutput(json=SCHEMA).key()
    reordered = {**SCHEMA, "properties": dict(reversed(list(SCHEMA["properties"].items())))}
    assert StructuredOutput(json=reordered).key() != StructuredOutput(json=SCHEMA).key()  # another grammar
    with pytest.raises(TypeError, match="`structural_tag` must be a dict or its non-empty JSON text"):
        StructuredOutput(structural_tag=["<tool_call>"])
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}
    assert StructuredOutput(structural_tag=tag).key() == StructuredOutput(structural_tag=json.dumps(tag)).key()


def test_without_xgrammar_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # an import of it raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'hf_accel\[structured\]'"):
        xgrammar()


CHI2_CRITICAL_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}  # chi-square quantiles at p = 0.001


def homogeneity_chi2(a: dict[str, int], b: dict[str, int]) -> tuple[float, int]:
    """Pearson's statistic that two samples over the same categories come from one distribution, and its degrees of
    freedom (categories seen at all, minus one)."""
    keys = [k for k in set(a) | set(b) if a.get(k, 0) + b.get(k, 0)]
    n_a, n_b = sum(a.values()), sum(b.values())
    statistic = 0.0
    for k in keys:
        total = a.get(k, 0) + b.get(k, 0)
        for count, n in ((a.get(k, 0), n_a), (b.get(k, 0), n_b)):
            expected = total * n / (n_a + n_b)
            statistic += (count - expected) ** 2 / expected
    return statistic, len(keys) - 1


@pytest.mark.parametrize("method", ["ngram", "draft", "jump_forward"])
def test_sampled_speculative_decoding_under_a_grammar_is_lossless(pair, method, monkeypatch):
    """Sampling with speculation (or jump-forward alone, generate's default) under a grammar draws from the same
    distribution as constrained plain sampling (`jump_forward=False`): the choice each output makes, over 400 samples
    each way, passes a chi-square homogeneity test (p = 0.001)."""
    model, tokenizer = pair
    choices = ["import os", "import sys", "import re", "import json"]  # decided after the shared, drafted prefix
    prompt = "# one of: import os, import sys, import re, import json\nline = import re\nline = "
    inputs = tokenizer([prompt], return_tensors="pt", add_special_tokens=False)
    forced_rounds = []
    drafting = ngram.with_forced_tokens
    monkeypatch.setattr(ngram, "with_forced_tokens", lambda *args: forced_rounds.append(1) or drafting(*args))
    counts = {}
    ways = {"plain": ({}, False), method: ({}, True) if method == "jump_forward" else
            (speculative_kwargs(pair, method, hf_accel.SpeculativeStats()), True)}
    for name, (kwargs, jump_forward) in ways.items():
        torch.manual_seed(7)
        tally: dict[str, int] = {}
        constraint = StructuredOutput(choice=choices, jump_forward=jump_forward)
        for _ in range(8):
            out = model.generate(**inputs, max_new_tokens=16, do_sample=True, temperature=1.5, num_return_sequences=50,
                                 structured_output=constraint, tokenizer=tokenizer,
                                 pad_token_id=tokenizer.pad_token_id, **kwargs)
            for row in out[:, inputs["input_ids"].shape[1]:]:
                text = tokenizer.decode(row, skip_special_tokens=True)
                if text not in choices:  # max_new_tokens first (sampled one character a token): a valid prefix
                    assert any(choice.startswith(text) for choice in choices), text
                    text = "(cut)"
                tally[text] = tally.get(text, 0) + 1
        counts[name] = tally
    assert bool(forced_rounds) == (method != "draft")  # jump-forward rounds ran in the arms that have them only
    statistic, dof = homogeneity_chi2(counts["plain"], counts[method])
    assert dof >= 2, counts  # the choice is not a foregone conclusion
    assert statistic < CHI2_CRITICAL_P001[dof], (statistic, counts)
