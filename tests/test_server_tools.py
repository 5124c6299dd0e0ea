"""Tool calls through the server with the real `openai` client: a named function's arguments and "required" calls
are constrained to the tools' schemas (valid JSON under each function's `parameters`, streamed pieces equal to the
whole reply, `chat.completions.parse` with a Pydantic tool), "auto" renders the tools through the chat template and
parses calls with the tokenizer's `response_template`, tool results go back through the template, and every choice
the server cannot honour is a 400 naming the field."""

from __future__ import annotations

import copy
import json

import jsonschema
import openai
import pydantic
import pytest
import torch

from hf_accel import reference
from hf_accel.server.tool_calls import Tool, ToolPlan, plan_tools
from server_helpers import MODEL_NAME, live_server, load_target, prompt_ids

pytest.importorskip("xgrammar")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}
CITY_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}


class Add(pydantic.BaseModel):
    a: int
    b: int


@pytest.fixture(scope="module")
def server():
    model, tokenizer = load_target()
    with live_server(model, tokenizer, max_num_seqs=8, enforce_eager=True) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


def streamed_calls(client, **kwargs) -> tuple[dict[int, dict], str | None]:
    """The calls a streamed reply assembles from its pieces, and its finish_reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": piece.id, "name": piece.function.name, "arguments": ""})
                assert piece.id is None or piece.id == call["id"]
                call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish


def test_named_function_arguments_fit_its_schema_streamed_or_not(client):
    request = {"model": MODEL_NAME, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 64,
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    out = client.chat.completions.create(**request)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    calls, finish = streamed_calls(client, **request)
    assert finish == "stop" and list(calls) == [0]
    assert (calls[0]["name"], calls[0]["arguments"]) == ("get_weather", call.function.arguments)


def test_required_calls_name_a_tool_and_fit_its_schema(client):
    request = {"model": MODEL_NAME, "messages": ASK, "tools": [CITY_TOOL], "tool_choice": "required",
               "temperature": 0, "max_tokens": 200}
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), CITY)
    calls, finish = streamed_calls(client, **request)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    # a reply held back until it finished still carries all its token ids and logprobs
    extras = {"logprobs": True, "extra_body": {"return_token_ids": True}}
    whole = client.chat.completions.create(**request, **extras).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **request, **extras) if c.choices]
    assert sum((c.token_ids or [] for c in chunks), []) == whole.token_ids
    assert sum(len(c.logprobs.content) for c in chunks if c.logprobs) == len(whole.logprobs.content)
    sampled = client.chat.completions.create(**{**request, "temperature": 1.0, "seed": 1, "n": 4})
    for choice in sampled.choices:
        if choice.finish_reason == "tool_calls":  # else cut by max_tokens
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), CITY)
    assert any(choice.finish_reason == "tool_calls" for choice in sampled.choices)


def test_parse_with_a_pydantic_function_tool(client):
    out = client.chat.completions.parse(model=MODEL_NAME, messages=[{"role": "user", "content": "Add 2 and 3."}],
                                        tools=[openai.pydantic_function_tool(Add)], temperature=0, max_tokens=32,
                                        tool_choice={"type": "function", "function": {"name": "Add"}})
    [call] = out.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Add)


def test_auto_renders_the_tools_and_replies_in_text(server, client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=12,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = out.choices[0]
    assert choice.message.tool_calls == [] and choice.finish_reason == "length"
    prompt = server.tokenizer.apply_chat_template(ASK, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    ids = prompt_ids(server.tokenizer, prompt)
    assert out.usage.prompt_tokens == len(ids)  # the tools are in the prompt
    model = reference.load("target")[0]
    expected = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert choice.token_ids == expected


def test_auto_reply_calls_are_parsed_by_the_response_template(server):
    tools = [Tool.model_validate(tool) for tool in TOOLS]
    plan = plan_tools(tools, None, server.tokenizer)
    prompt = server.tokenizer.apply_chat_template(ASK, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    reply = 'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'
    content, [call] = plan.parse(reply, prompt, server.tokenizer)
    assert content == "Checking." and call.name == "get_weather" and json.loads(call.arguments) == {
        "city": "Oslo", "days": 2}
    broken = 'Checking. <tool_call>{"name": "get_weather", "argu'
    assert plan.parse(broken, prompt, server.tokenizer) == (broken, [])  # not a call: the reply stays text
    assert plan.parse("plain text", prompt, server.tokenizer) == ("plain text", [])
    without_parser = copy.copy(server.tokenizer)
    without_parser.response_template = None
    with pytest.raises(ValueError, match='`tool_choice` "auto" needs the tokenizer\'s `response_template`'):
        plan_tools(tools, "auto", without_parser)
    assert plan_tools(tools, "required", without_parser).mode == "required"
    assert ToolPlan("none", tools).parse("x", prompt, server.tokenizer) == ("x", [])


def test_auto_calls_are_constrained_to_the_tools_once_the_template_opens_one(server):
    """The reference template writes calls as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`: "auto"
    replies get a structural tag from it (vLLM's strict tool calling): text is free, a call must name a tool and fit
    its schema, and close."""
    from hf_accel.structured.grammars import compile_constraint, compiler_for, xgrammar

    tools = [Tool.model_validate(tool) for tool in TOOLS]
    plan = plan_tools(tools, "auto", server.tokenizer)
    assert plan.call_format is not None and plan.call_format.open == "<tool_call>"
    compiled = compile_constraint(plan.constraint(), compiler_for(server.tokenizer, len(server.tokenizer), None))

    def accepts(text: str) -> bool:
        return xgrammar().GrammarMatcher(compiled).accept_string(text)

    assert accepts("Let me check. ")
    assert accepts('Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'
                   ' Done.')
    assert accepts('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert not accepts('<tool_call>{"name": "get_time"')  # not a tool
    assert not accepts('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 9}')  # maximum 7
    assert not accepts('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}.')  # not closed
    other = copy.copy(server.tokenizer)  # a template that does not mark calls as JSON: parsed, not constrained
    other.response_template = {"fields": {"tool_calls": {"content": "text", "open": "<call>", "close": "</call>"}}}
    assert plan_tools(tools, "auto", other).constraint() is None
    assert plan_tools(tools, "required", server.tokenizer).call_format is None


def assembled(stream, text: str, step: int) -> tuple[str, dict[int, dict]]:
    """Feed `text` to an `AutoCallStream` `step` characters at a time: the content and calls its deltas assemble."""
    content, calls = "", {}
    for end in range(step, len(text) + step, step):
        message = stream.feed(text[:end], finished=end >= len(text))
        content += message.content or ""
        for piece in message.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": piece.id, "name": piece.function.name, "arguments": ""})
            assert piece.id is None or piece.id == call["id"]
            call["arguments"] += piece.function.arguments or ""
    return content, calls


@pytest.mark.parametrize("step", [1, 3, 7])
def test_auto_calls_stream_as_they_are_generated(server, step):
    """"auto" with a known call format and "required" stream content and each call's pieces as they come (text
    that may open a call held until it cannot); the pieces assemble into the calls the whole reply parses to."""
    from hf_accel.server.tool_stream import AutoCallStream, RequiredCallStream

    tools = [Tool.model_validate(tool) for tool in TOOLS]
    plan = plan_tools(tools, "auto", server.tokenizer)
    prompt = server.tokenizer.apply_chat_template(ASK, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    reply = ('Let me check <tool. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
             '</tool_call> and <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> ok')
    content, calls = assembled(AutoCallStream(plan.call_format, ["get_weather", "add"]), reply, step)
    _, parsed = plan.parse(reply, prompt, server.tokenizer)
    assert len(parsed) == 2 and [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(call.name, json.loads(call.arguments)) for call in parsed]
    assert content == "Let me check <tool.  and  ok" and all(c["id"].startswith("call_") for c in calls.values())
    tricky = '<tool_call>{"name": "get_weather", "arguments": {"city": "}</tool_call>\\"", "days": 2}}</tool_call>'
    _, calls = assembled(AutoCallStream(plan.call_format, ["get_weather"]), tricky, step)  # JSON strings followed
    assert json.loads(calls[0]["arguments"]) == {"city": '}</tool_call>"', "days": 2}
    cut = 'Sure <tool_call>{"name": "add", "arguments": {"a": 1, "b'  # max_tokens: the call stays unfinished
    stream = AutoCallStream(plan.call_format, ["get_weather", "add"])
    content, calls = assembled(stream, cut, step)
    assert content == "Sure " and calls[0]["arguments"] == '{"a": 1, "b' and stream.finished_calls == 0
    content, calls = assembled(AutoCallStream(plan.call_format, ["add"]), "a <tool_ca", step)
    assert content == "a <tool_ca" and not calls  # an opening cut short goes out as content at the end
    required = '[{"name": "add", "parameters": {"a": 1, "b": [2, "]}"]}}, {"name": "get_weather", "parameters": {}}]'
    content, calls = assembled(RequiredCallStream(["get_weather", "add"]), required, step)
    assert content == "" and [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("add", '{"a": 1, "b": [2, "]}"]}'), ("get_weather", "{}")]
    whole = ToolPlan("required", tools).parse(required, prompt, server.tokenizer)[1]
    assert [(call.name, call.arguments) for call in whole] == [(c["name"], c["arguments"]) for c in calls.values()]
    assert ToolPlan("required", tools).parse(required[:-30], prompt, server.tokenizer) == (required[:-30], [])


def test_auto_text_streams_as_it_comes(server, client):
    request = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=12,
                   extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**request).choices[0].message.content
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **request) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == whole
    assert sum(1 for c in chunks if c.delta.content) > 2  # not one chunk at the end


def test_a_tool_result_goes_back_through_the_template(server, client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "days": 1}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice="none",
                                         temperature=0, max_tokens=8)
    template_messages = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    prompt = server.tokenizer.apply_chat_template(template_messages, tools=TOOLS, tokenize=False,
                                                  add_generation_prompt=True)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}</tool_call>' in prompt
    assert out.usage.prompt_tokens == len(prompt_ids(server.tokenizer, prompt))


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_tool_choices_that_cannot_be_honoured_are_400(client, body, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=4, extra_body=body)
    assert refused.value.body["param"] == param, refused.value.body
