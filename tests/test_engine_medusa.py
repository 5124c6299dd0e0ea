"""Medusa speculation inside the Engine: greedy outputs equal plain greedy `generate` (tiny random models with
random heads, where nearly every candidate is rejected, and the reference target with its trained heads), stops
exact, prefix cache and preemption correct, sampled requests unaffected, counters plausible, the pool free after."""

import copy
import functools
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from conformance import make_model
from engine_helpers import assert_greedy_equal, greedy_reference, random_prompts
from hf_accel import Engine, EngineConfig, MedusaHeads, SamplingParams, SpeculativeConfig, reference
from hf_accel.engine.spec_decode.medusa_proposer import MedusaProposer
from hf_accel.engine.outputs import RequestTiming
from hf_accel.engine.sequence import Request, Sequence, make_sequences
from hf_accel.engine.scheduler import draft_width
from hf_accel.reference import ASSETS_DIR
from hf_accel.server import command
from hf_accel.speculative.verify import greedy_accept
from test_server_cli import ROOT, free_port, wait_for_health

LENGTHS = [5, 23, 9, 40, 17, 3, 12, 30]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


@functools.lru_cache(maxsize=None)
def tiny_with_heads(arch: str = "llama") -> tuple[torch.nn.Module, MedusaHeads]:
    model = make_model(arch, torch.float32, "sdpa")
    with torch.random.fork_rng():
        torch.manual_seed(3)
        heads = MedusaHeads.for_model(model, num_heads=3, init_from_lm_head=False).eval()
    return model, heads


@functools.lru_cache(maxsize=None)
def reference_with_heads():
    model, tokenizer = reference.load("target")
    heads = MedusaHeads.from_pretrained(ASSETS_DIR / "medusa", dtype=torch.float32)
    return model, tokenizer, heads


def reference_prompts(lengths: list[int]) -> list[list[int]]:
    _, tokenizer, _ = reference_with_heads()
    rows = reference.held_out_sequences(tokenizer, seq_len=64, max_rows=len(lengths))
    return [row[:n].tolist() for row, n in zip(rows, lengths)]


def decoding_sequence(tokens: list[int], temperature: float = 0.0) -> Sequence:
    """A sequence whose prompt is computed but its last token: it decodes next."""
    request = Request("r", None, tokens, SamplingParams(max_tokens=8, temperature=temperature), 0, RequestTiming(0.0))
    make_sequences(request, lambda params: None)
    request.sequences[0].num_computed_tokens = len(tokens) - 1
    return request.sequences[0]


def assert_pool_free(engine: Engine) -> None:
    assert engine.core.proposer.num_tracked == 0  # the proposer keeps nothing of finished sequences
    blocks = engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks  # every block free, or held only by the prefix cache
    assert blocks.pool.num_used_blocks == 0  # cached blocks no sequence uses are free (in the free queue)


def test_draft_width_rule():
    assert [draft_width(n, 4, 16) for n in (0, 1, 2, 3, 4, 5, 8, 9)] == [0, 4, 4, 4, 3, 2, 1, 0]
    assert draft_width(1, 2, 64) == 2  # never more than the heads give


def accepted_prefix(drafts: list[int], target: list[int]) -> int:
    return int(greedy_accept(torch.tensor([drafts]), torch.tensor([target])).num_accepted[0])


def test_accepted_prefix():
    """The engine's verification rule is `greedy_accept` on one row's candidates and target argmaxes."""
    assert accepted_prefix([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted_prefix([5, 6, 7], [4, 6, 7, 1]) == 0
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 1]) == 3


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_random_heads_match_generate(arch):
    """Random heads: nearly every candidate is rejected, so the rollback path runs on every step."""
    model, heads = tiny_with_heads(arch)
    prompts = random_prompts(LENGTHS, seed=1)
    engine = Engine(model, config=EngineConfig(max_num_seqs=8, block_size=4),
                    speculative=SpeculativeConfig("medusa", model=heads, max_speculative_batch_tokens=64))
    outputs = engine.generate(prompts, [greedy(6 + i) for i in range(len(prompts))])
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert out.finish_reason == "length" and len(out.token_ids) == 6 + i
        assert_greedy_equal(model, prompt, out.token_ids, greedy_reference(model, prompt, 6 + i))
    stats = engine.stats()
    assert stats.spec_decode_num_drafts > 0
    assert 0 <= stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_pool_free(engine)


def test_reference_heads_match_plain_engine_and_accept():
    model, tokenizer, heads = reference_with_heads()
    prompts = reference_prompts(LENGTHS)
    params = [greedy(24 + 3 * i) for i in range(len(prompts))]
    plain = Engine(model, tokenizer, config=EngineConfig(max_num_seqs=8)).generate(prompts, params)
    engine = Engine(model, tokenizer, config=EngineConfig(max_num_seqs=8),
                    speculative=SpeculativeConfig("medusa", model=heads, max_speculative_batch_tokens=64))
    spec = engine.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec[0].token_ids == greedy_reference(model, prompts[0], 24)
    stats = engine.stats()
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_drafts > 0.5  # trained heads help
    assert stats.num_steps < sum(p.max_tokens for p in params) / len(params)
    assert_pool_free(engine)


def test_proposer_matches_the_heads():
    model, heads = tiny_with_heads()
    heads = copy.deepcopy(heads)  # the cached heads stay as they are for the other tests
    with torch.no_grad():
        for block in heads.blocks:  # non-zero residual layers, so they matter
            block.layers[0].weight.normal_(std=0.3)
    proposer = MedusaProposer(heads, num_speculative_tokens=2)
    hidden = torch.randn(5, heads.config.hidden_size)
    seqs = [decoding_sequence([3, 4, 5]) for _ in range(5)]
    assert not any(proposer.can_propose(seq) for seq in seqs)  # no state kept yet
    for seq, row in zip(seqs, hidden):
        proposer.observe(seq, row)
    assert all(proposer.can_propose(seq) for seq in seqs)
    with torch.no_grad():
        expected = heads(hidden).argmax(dim=-1)[:2].T.tolist()
    assert proposer.propose(seqs, [2] * 5) == expected
    assert proposer.propose(seqs[::-1], [1] * 5) == [row[:1] for row in expected[::-1]]
    assert proposer.propose(seqs[:2], [1, 2]) == [expected[0][:1], expected[1]]  # per-row counts
    sampled = decoding_sequence([3, 4], temperature=0.7)
    proposer.observe(sampled, hidden[0])  # sampled rows are never verified greedily: nothing kept
    proposer.forget(seqs[0])
    assert not proposer.can_propose(sampled) and not proposer.can_propose(seqs[0]) and proposer.num_tracked == 4
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        MedusaProposer(heads, num_speculative_tokens=4)


def test_stops_and_max_tokens_are_exact():
    """Accepted candidates are appended one at a time: no stop rule is overshot inside a verified chain."""
    model, tokenizer, heads = reference_with_heads()
    prompt = reference_prompts([40])[0]
    free = Engine(model, tokenizer).generate([prompt], greedy(40))[0]
    engine = Engine(model, tokenizer, speculative=SpeculativeConfig("medusa", model=heads))
    for max_tokens in (1, 2, 3, 7, 19):
        out = engine.generate([prompt], greedy(max_tokens))[0]
        assert out.token_ids == free.token_ids[:max_tokens] and out.finish_reason == "length"
    for index in (3, 11, 25):
        token = free.token_ids[index]
        out = engine.generate([prompt], greedy(40, stop_token_ids=[token]))[0]
        assert out.token_ids == free.token_ids[: free.token_ids.index(token) + 1]
        assert out.outputs[0].stop_reason == token
    stop_text = free.text[len(free.text) // 2:][:4]
    assert stop_text.strip(), "the reference output should hold text to stop at"
    out = engine.generate([prompt], greedy(40, stop=[stop_text]))[0]
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(stop_text)]
    assert engine.stats().spec_decode_num_accepted_tokens > 0  # chains were accepted, and cut where they must be
    assert_pool_free(engine)


def test_logprobs_come_from_the_target_at_each_position():
    model, tokenizer, heads = reference_with_heads()
    prompts = reference_prompts([20, 33])
    params = greedy(16, logprobs=2)
    plain = Engine(model, tokenizer).generate(prompts, params)
    spec = Engine(model, tokenizer, speculative=SpeculativeConfig("medusa", model=heads)).generate(prompts, params)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_prefix_cache_holds_only_committed_blocks():
    """A speculating request's blocks enter the prefix cache; a later prompt that extends its output reuses them and
    still decodes exactly as plain generate (garbage K/V from rejected candidates never reaches a cached block)."""
    model, heads = tiny_with_heads()
    prompts = random_prompts([9, 14], seed=8)
    engine = Engine(model, config=EngineConfig(block_size=4),
                    speculative=SpeculativeConfig("medusa", model=heads, max_speculative_batch_tokens=64))
    first = engine.generate(prompts, greedy(20))
    assert engine.stats().spec_decode_num_drafts > 0
    extended = [p + out.token_ids[:15] for p, out in zip(prompts, first)]
    hits_before = engine.stats().prefix_cache_hits
    second = engine.generate(extended, greedy(10))
    assert engine.stats().prefix_cache_hits - hits_before >= sum(len(p) // 4 * 4 - 4 for p in extended)
    for prompt, out in zip(extended, second):
        assert_greedy_equal(model, prompt, out.token_ids, greedy_reference(model, prompt, 10))
    assert_pool_free(engine)


def test_preemption_under_a_tiny_pool():
    model, heads = tiny_with_heads()
    prompts = random_prompts([20, 18, 22, 16, 19, 21], seed=9)
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, head_dim 16, fp32
    engine = Engine(model, config=EngineConfig(max_num_seqs=6, kv_cache_memory=per_token * 4 * 24, block_size=4,
                                               max_model_len=60),
                    speculative=SpeculativeConfig("medusa", model=heads, max_speculative_batch_tokens=64))
    outputs = engine.generate(prompts, greedy(24))
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_drafts > 0
    for prompt, out in zip(prompts, outputs):
        assert_greedy_equal(model, prompt, out.token_ids, greedy_reference(model, prompt, 24))
    assert_pool_free(engine)


def test_sampled_and_penalised_requests_decode_plainly():
    model, heads = tiny_with_heads()
    prompts = random_prompts([6, 11, 8, 13], seed=2)
    params = [greedy(9), SamplingParams(max_tokens=9, temperature=0.8, top_k=20, seed=3, n=2, ignore_eos=True),
              greedy(9, repetition_penalty=1.3), greedy(9)]
    plain = Engine(model, config=EngineConfig(block_size=4)).generate(prompts, params)
    engine = Engine(model, config=EngineConfig(block_size=4),
                    speculative=SpeculativeConfig("medusa", model=heads, max_speculative_batch_tokens=64))
    spec = engine.generate(prompts, params)
    for a, b in zip(plain, spec):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    # only the two plain-greedy requests speculate: at most one round per step each
    assert 0 < engine.stats().spec_decode_num_drafts <= 2 * 9
    assert_pool_free(engine)


def test_no_speculation_once_the_batch_is_past_the_threshold():
    model, heads = tiny_with_heads()
    prompts = random_prompts([5, 6, 7, 8, 9], seed=3)
    engine = Engine(model, config=EngineConfig(block_size=4),  # 5 x (1 + 1) > 9
                    speculative=SpeculativeConfig("medusa", model=heads, max_speculative_batch_tokens=9))
    engine.generate(prompts, greedy(6))
    assert engine.stats().spec_decode_num_drafts == 0
    engine.generate(prompts[:2], greedy(6))  # 2 x (1 + 3) <= 9: every head, fewer only near max_tokens
    stats = engine.stats()
    assert stats.spec_decode_num_draft_tokens > 2 * stats.spec_decode_num_drafts > 0


def test_serve_with_medusa_heads_through_the_openai_client():
    """`hf-accel serve --medusa-heads` in a subprocess: greedy completions (plain and streamed, concurrent) equal
    plain greedy generate, and /metrics counts the speculation."""
    model, tokenizer, _ = reference_with_heads()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "hf_accel.cli", "serve", "--port", str(port), "--medusa-heads",
                             str(ASSETS_DIR / "medusa"), "--num-speculative-tokens", "3", "--max-num-seqs", "4",
                             "--threads", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, proc)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        prompts = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def"]

        def complete(prompt: str) -> str:
            return client.completions.create(model=command.REFERENCE_NAME, prompt=prompt, max_tokens=24,
                                             temperature=0, extra_body={"ignore_eos": True}).choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(complete, prompts))
        stream = client.completions.create(model=command.REFERENCE_NAME, prompt=prompts[0], max_tokens=24,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == texts[0]
        for prompt, text in zip(prompts, texts):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            assert text == tokenizer.decode(greedy_reference(model, ids, 24), skip_special_tokens=True)
        metrics = httpx.get(f"{url}/metrics").text
        drafts = float(re.search(r"^hf_accel:spec_decode_num_drafts_total\{.*\} (\S+)$", metrics, re.M).group(1))
        proposed = float(re.search(r"^hf_accel:spec_decode_num_draft_tokens_total\{.*\} (\S+)$", metrics, re.M)[1])
        accepted = float(re.search(r"^hf_accel:spec_decode_num_accepted_tokens_total\{.*\} (\S+)$", metrics, re.M)[1])
        assert 0 < accepted <= proposed <= 3 * drafts
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def test_serve_refuses_speculation_options_without_heads():
    with pytest.raises(SystemExit):
        command.main(["--num-speculative-tokens", "2"])
