"""Constrained output through the server with the real `openai` client: `chat.completions.parse` with a Pydantic
model, `response_format` json_schema and json_object, vLLM's `structured_outputs` (regex, choice, grammar) on
completions, streamed and not, with `n` samples and with speculation; outputs equal constrained `generate` at
temperature 0; a constraint the backend refuses is a 400 and the server goes on serving."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from hf_accel import SpeculativeConfig, StructuredOutput
from server_helpers import MODEL_NAME, live_server, load_target, prompt_ids

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "color": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "color"], "additionalProperties": False}


class Pet(pydantic.BaseModel):
    kind: str = pydantic.Field(max_length=10)
    legs: int = pydantic.Field(ge=0, le=8)


@pytest.fixture(scope="module", params=[None, "suffix"])
def server(request):
    model, tokenizer = load_target()
    speculative = None if request.param is None else SpeculativeConfig(request.param, num_speculative_tokens=4)
    with live_server(model, tokenizer, max_num_seqs=8, enforce_eager=True, speculative=speculative) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


def constrained_generate(tokenizer, ids: list[int], constraint: StructuredOutput, max_new: int) -> list[int]:
    import torch

    from hf_accel import reference

    model = reference.load("target")[0]
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, structured_output=constraint,
                         tokenizer=tokenizer, do_sample=False)
    return out[0, len(ids):].tolist()


def test_parse_with_a_pydantic_model(client):
    messages = [{"role": "user", "content": "Describe a pet as JSON."}]
    for temperature in (0, 1.0):
        out = client.chat.completions.parse(model=MODEL_NAME, messages=messages, response_format=Pet, max_tokens=64,
                                            temperature=temperature, seed=3, n=2)
        for choice in out.choices:
            assert choice.finish_reason == "stop"
            assert isinstance(choice.message.parsed, Pet)


def test_json_schema_at_temperature_zero_equals_constrained_generate(server, client):
    messages = [{"role": "user", "content": "A record, please."}]
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=64, temperature=0, extra_body={"return_token_ids": True},
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}})
    choice = out.choices[0]
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    ids = prompt_ids(server.tokenizer, server.tokenizer.apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=True))
    assert choice.token_ids == constrained_generate(server.tokenizer, ids, StructuredOutput(json=SCHEMA), 64)


def test_json_object_and_streamed_structured_outputs(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "JSON?"}],
                                         max_tokens=96, temperature=0, response_format={"type": "json_object"})
    text = out.choices[0].message.content
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: an object still open
        assert text.startswith("{")
    no_schema = client.chat.completions.create(  # a json_schema format without `schema` (optional): any object
        model=MODEL_NAME, messages=[{"role": "user", "content": "JSON?"}], max_tokens=96, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "anything"}})
    assert no_schema.choices[0].message.content == text
    pattern = r"[a-z]{3}-[0-9]{2}"
    chunks = client.completions.create(model=MODEL_NAME, prompt="code = '", max_tokens=20, temperature=0,
                                       stream=True, extra_body={"structured_outputs": {"regex": pattern}})
    streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert re.fullmatch(pattern, streamed)


def test_choice_and_grammar_on_completions(client):
    choices = ["import os", "import sys", "pass"]
    out = client.completions.create(model=MODEL_NAME, prompt=["def main():\n    ", "x = 1\n"], max_tokens=8,
                                    temperature=0.8, seed=1, extra_body={"structured_outputs": {"choice": choices}})
    assert all(choice.text in choices and choice.finish_reason == "stop" for choice in out.choices)
    grammar = 'root ::= "(" number ("," number)* ")"\nnumber ::= [1-9] [0-9]*'
    out = client.completions.create(model=MODEL_NAME, prompt="point = ", max_tokens=24, temperature=0,
                                    extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"\([1-9][0-9]*(,[1-9][0-9]*)*\)", out.choices[0].text)
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["("], "tags": [
        {"begin": "(", "content": {"type": "json_schema", "json_schema": {"type": "integer"}}, "end": ")"}]}}
    out = client.completions.create(model=MODEL_NAME, prompt="def main():\n    print", max_tokens=24, temperature=0,
                                    extra_body={"structured_outputs": {"structural_tag": json.dumps(tag)}})
    text = out.choices[0].text  # free text, but every argument is an integer
    calls = re.findall(r"\(([^)]*)\)", text)
    assert calls and all(re.fullmatch(r"-?(0|[1-9][0-9]*)", call) for call in calls), text


def test_a_refused_constraint_is_400_and_the_server_goes_on(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"json": {"type": "strin"}}})
    assert refused.value.body["param"] == "structured_outputs" and "strin" in refused.value.body["message"]
    out = client.completions.create(model=MODEL_NAME, prompt="x = ", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length"
