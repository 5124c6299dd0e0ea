"""The OpenAI-compatible server with the real `openai` client on a loopback port: completions and chat, streamed
and not, `n > 1`, `stop`, `max_tokens`, seeds, logprobs, temperature 0 against `model.generate` greedy, and the
/v1/models, /tokenize, /detokenize endpoints."""

import httpx
import openai
import pytest

from engine_helpers import assert_greedy_equal, greedy_reference
from hf_accel import reference
from server_helpers import MODEL_NAME, live_server, load_target, prompt_ids

PROMPTS = ["def add(a, b):", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self):"]
GREEDY = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def server():
    model, tokenizer = load_target()
    with live_server(model, tokenizer, max_num_seqs=8) as live:
        yield live


@pytest.fixture(scope="module")
def ref_model():
    """A second copy of the target for `generate`, so references never share a model with the engine's thread."""
    return reference.load("target")[0]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


def chat_prompt_ids(server, messages) -> list[int]:
    text = server.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prompt_ids(server.tokenizer, text)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_at_temperature_zero_equals_generate(server, client, ref_model, prompt):
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, extra_body=GREEDY)
    choice = out.choices[0]
    ids = prompt_ids(server.tokenizer, prompt)
    assert_greedy_equal(ref_model, ids, choice.token_ids, greedy_reference(ref_model, ids, 16))
    assert choice.text == server.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    assert choice.finish_reason == "length" and out.model == MODEL_NAME and out.object == "text_completion"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 16)


def test_chat_at_temperature_zero_equals_generate(server, client, ref_model):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                         extra_body=GREEDY)
    ids = chat_prompt_ids(server, messages)
    choice = out.choices[0]
    assert_greedy_equal(ref_model, ids, choice.token_ids, greedy_reference(ref_model, ids, 12))
    assert choice.message.role == "assistant" and choice.message.content == server.tokenizer.decode(
        choice.token_ids, skip_special_tokens=True)
    assert out.object == "chat.completion" and out.usage.prompt_tokens == len(ids)


def test_completion_stream_equals_non_stream_with_usage_chunk(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=20, temperature=0, n=2, extra_body=GREEDY)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts, reasons = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices  # one choice per chunk
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            reasons[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices} and reasons == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert len({chunk.id for chunk in chunks}) == 1


def test_chat_stream_with_n_samples_is_seeded(client):
    messages = [{"role": "user", "content": "import json"}]
    kwargs = dict(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=1.0, seed=11, n=2,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    texts = {0: "", 1: ""}
    for chunk in chunks:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert texts[0] != texts[1], "sample i is seeded with seed + i"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seed_reproducible_and_different_seeds_differ(client):
    def sample(seed):
        return client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=24, temperature=1.0,
                                         top_p=0.95, seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    first = sample(3)
    assert sample(3) == first
    assert sample(4) != first


def test_stop_string_and_max_tokens(client):
    free = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0]
    half = len(free.text) // 2
    stop = next(free.text[i:i + 3] for i in range(half, len(free.text) - 2) if free.text[i:i + 3].strip())
    stopped = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                        stop=[stop]).choices[0]
    assert stopped.text == free.text[: free.text.index(stop)]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    short = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 5
    ids = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                    extra_body=GREEDY).choices[0].token_ids
    by_token = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                         extra_body={**GREEDY, "stop_token_ids": [ids[3]]}).choices[0]
    assert by_token.token_ids == ids[: ids.index(ids[3]) + 1]  # the stop token is kept, as EOS is
    assert by_token.finish_reason == "stop" and by_token.stop_reason == ids[3]


def test_several_prompts_with_n_samples_number_choices_by_prompt(client, server):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], n=2, max_tokens=6, temperature=0,
                                    extra_body=GREEDY)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=6, temperature=0,
                                       extra_body=GREEDY).choices[0].token_ids for p in PROMPTS[:2]]
    assert [c.token_ids for c in out.choices] == [alone[0], alone[0], alone[1], alone[1]]
    lengths = [len(prompt_ids(server.tokenizer, p)) for p in PROMPTS[:2]]
    assert out.usage.prompt_tokens == sum(lengths) and out.usage.completion_tokens == 24
    streamed = {index: [] for index in range(4)}
    for chunk in client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], n=2, max_tokens=6, temperature=0,
                                           stream=True, extra_body=GREEDY):
        streamed[chunk.choices[0].index] += chunk.choices[0].token_ids
    assert streamed == {c.index: c.token_ids for c in out.choices}


def test_logprobs_of_completions_and_chat(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2,
                                    extra_body=GREEDY).choices[0]
    assert len(out.logprobs.tokens) == 4
    if out.text.isascii():  # a multi-byte character split over tokens has no per-token text
        assert "".join(out.logprobs.tokens) == out.text
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(lp, abs=1e-5)
               for top, lp in zip(out.logprobs.top_logprobs, out.logprobs.token_logprobs))
    assert out.logprobs.text_offset == [sum(map(len, out.logprobs.tokens[:i])) for i in range(4)]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x = "}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=3).choices[0]
    content = chat.logprobs.content
    assert len(content) == 3 and all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in content)
    assert content[0].bytes == list(content[0].token.encode())


def test_models_tokenize_and_detokenize(server, client):
    (card,) = client.models.list().data
    assert card.id == MODEL_NAME and card.max_model_len == server.engine.max_model_len
    text = "def add(a, b):"
    tokenized = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, "prompt": text,
                                                             "return_token_strs": True}).json()
    ids = prompt_ids(server.tokenizer, text)
    assert tokenized["tokens"] == ids and tokenized["count"] == len(ids)
    assert tokenized["max_model_len"] == server.engine.max_model_len
    assert tokenized["token_strs"] == server.tokenizer.convert_ids_to_tokens(ids)
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json() == {"prompt": text}
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == chat_prompt_ids(server, messages)
