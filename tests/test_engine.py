"""Engine outputs against plain `generate`: greedy equality on tiny models of every conformance architecture,
with and without chunked prefill, and the request-level behaviours (stops, lengths, n, seeds, logprobs, errors)."""

import copy

import pytest
import torch

from conformance import ARCHITECTURES, make_model, make_tokenizer
from engine_helpers import assert_greedy_equal, greedy_reference, random_prompts
from hf_accel import ContextLengthExceededError, Engine, EngineConfig, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LENGTHS = [5, 23, 9, 40, 17, 3]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("chunk", [512, 7], ids=["whole-prefill", "chunked-prefill"])
def test_greedy_equals_generate(arch, chunk):
    attn = "eager" if arch == "gemma2" else "sdpa"
    model = make_model(arch, torch.float32, attn)
    prompts = random_prompts(LENGTHS, seed=1)
    engine = Engine(model, config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=chunk, block_size=4))
    outputs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs):
        assert out.finish_reason == "length" and len(out.token_ids) == 12
        assert_greedy_equal(model, prompt, out.token_ids, greedy_reference(model, prompt, 12))
    assert model.config._attn_implementation == attn, "the engine must restore the model's attention"
    blocks = engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks  # every block free, or held only by the prefix cache
    assert blocks.pool.num_used_blocks == 0  # cached blocks no sequence uses are free (in the free queue)


def test_mixed_parameters_in_one_batch():
    model = make_model("llama", torch.float32, "sdpa")
    prompts = random_prompts([6, 11, 8], seed=2)
    params = [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.8, top_k=20, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0, repetition_penalty=1.3, ignore_eos=True)]
    outputs = Engine(model, config=EngineConfig(block_size=4)).generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == [5, 9, 7]
    assert outputs[0].token_ids == greedy_reference(model, prompts[0], 5)
    ids = torch.tensor([prompts[2]])
    penalised = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=7, min_new_tokens=7,
                               do_sample=False, repetition_penalty=1.3, pad_token_id=0)[0, len(prompts[2]):]
    assert outputs[2].token_ids == penalised.tolist()


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    model = make_model("qwen3", torch.float32, "sdpa")
    prompt = random_prompts([10], seed=4)[0]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=2, ignore_eos=True)
    alone = Engine(model, config=EngineConfig(block_size=4)).generate([prompt], params)[0]
    others = random_prompts([4, 30, 12], seed=5)
    batched = Engine(model, config=EngineConfig(block_size=4)).generate(others + [prompt], [GREEDY] * 3 + [params])[-1]
    assert [o.token_ids for o in alone.outputs] == [o.token_ids for o in batched.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids  # seed + i per sample


def test_stop_strings_stop_tokens_and_eos():
    model = copy.deepcopy(make_model("llama", torch.float32, "sdpa"))  # its generation config changes below
    tokenizer = make_tokenizer()
    prompt = random_prompts([8], seed=6)[0]
    free = Engine(model, tokenizer, config=EngineConfig(block_size=4)).generate([prompt], GREEDY)[0]
    stop_text = free.text[len(free.text) // 2:][:3]
    assert stop_text.strip(), "the tiny model's text should hold something to stop at"
    by_string = Engine(model, tokenizer).generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                                         stop=[stop_text]))[0]
    assert by_string.finish_reason == "stop" and by_string.outputs[0].stop_reason == stop_text
    assert by_string.text == free.text[: free.text.index(stop_text)]
    token = free.token_ids[4]
    by_token = Engine(model, tokenizer).generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                                        stop_token_ids=[token]))[0]
    first = free.token_ids.index(token)
    assert by_token.token_ids == free.token_ids[: first + 1] and by_token.outputs[0].stop_reason == token
    model.generation_config.eos_token_id = token
    by_eos = Engine(model, tokenizer).generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    assert by_eos.token_ids == free.token_ids[: first + 1] and by_eos.finish_reason == "stop"


def test_logprobs_match_log_softmax_of_the_model():
    model = make_model("llama", torch.float32, "sdpa")
    prompt = random_prompts([9], seed=8)[0]
    out = Engine(model).generate([prompt], SamplingParams(max_tokens=3, temperature=0, logprobs=2,
                                                          ignore_eos=True))[0]
    logprobs = out.outputs[0].logprobs
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
    assert logprobs[0].token_id == out.token_ids[0]
    assert logprobs[0].logprob == pytest.approx(float(expected.max()), abs=1e-4)
    assert [t for t, _ in logprobs[0].top] == expected.topk(2).indices.tolist()


def test_string_prompts_and_text():
    model = make_model("llama", torch.float32, "sdpa")
    tokenizer = make_tokenizer()
    out = Engine(model, tokenizer).generate("w5 w6 w7", GREEDY)[0]
    assert out.prompt == "w5 w6 w7" and out.prompt_token_ids == tokenizer("w5 w6 w7", add_special_tokens=False)[
        "input_ids"]
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(temperature=-1), ValueError, "temperature"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(min_p=2.0), ValueError, "min_p"),
    (dict(repetition_penalty=0), ValueError, "repetition_penalty"),
    (dict(stop=[3]), TypeError, "stop"),
    (dict(stop_token_ids=["a"]), TypeError, "stop_token_ids"),
    (dict(n=0), ValueError, "`n`"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(logprobs=-2), ValueError, "logprobs"),
    (dict(temperature="hot"), TypeError, "temperature"),
])
def test_bad_sampling_params_name_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_bad_requests_and_settings():
    model = make_model("llama", torch.float32, "sdpa")
    engine = Engine(model, config=EngineConfig(max_model_len=32))
    with pytest.raises(ContextLengthExceededError, match="maximum context length is 32"):
        engine.add_request(list(range(4, 24)), SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([4, 999])
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("text without a tokenizer")
    with pytest.raises(TypeError, match="params"):
        engine.add_request([4, 5], {"max_tokens": 3})
    with pytest.raises(ValueError, match="params"):
        engine.generate([[4, 5], [6, 7]], [GREEDY])
    with pytest.raises(ValueError, match="kv_cache_memory"):
        Engine(model, config=EngineConfig(kv_cache_memory="1KiB"))
    with pytest.raises(ValueError, match="max_num_seqs"):
        Engine(model, config=EngineConfig(max_num_seqs=0))
    assert not engine.has_unfinished_requests()
