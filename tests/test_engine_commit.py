"""The step's commit (`hf_accel/engine/commit.py`): `check_stop`, the one stop rule, decides exactly as its rules say,
in their order; an engine without speculation has the null proposer, which is never given room for candidates."""

import torch

from conformance import make_model
from engine_helpers import random_prompts
from hf_accel import Engine, EngineConfig, SamplingParams
from hf_accel.engine.commit import Finish, check_stop
from hf_accel.engine.outputs import RequestTiming
from hf_accel.engine.sequence import Request, Sequence, make_sequences
from hf_accel.engine.spec_decode import NullProposer

EOS = {2}


def sequence(tokens: list[int], **params) -> Sequence:
    """A sample of prompt [5, 6, 7] that has produced `tokens`."""
    request = Request("r", None, [5, 6, 7], SamplingParams(**params), 0, RequestTiming(0.0))
    make_sequences(request, lambda params: None)
    seq = request.sequences[0]
    for token in tokens:
        seq.append_token(token, None, 0.0)
    return seq


def test_check_stop_rules_in_order():
    assert check_stop(sequence([8]), None, EOS, 64) is None
    assert check_stop(sequence([2], stop_token_ids=[2]), "ab", EOS, 64) == Finish("stop", "ab")  # a stop string first
    assert check_stop(sequence([2], stop_token_ids=[2]), None, EOS, 64) == Finish("stop", 2)  # then a stop token
    assert check_stop(sequence([2]), None, EOS, 64) == Finish("stop")  # then EOS
    assert check_stop(sequence([2], ignore_eos=True), None, EOS, 64) is None
    assert check_stop(sequence([2, 8], ignore_eos=True, max_tokens=2), None, EOS, 64) == Finish("length")
    assert check_stop(sequence([8, 2], max_tokens=2), None, EOS, 64) == Finish("stop")  # EOS before max_tokens
    assert check_stop(sequence([8, 9]), None, EOS, 5) == Finish("length")  # prompt 3 + 2 tokens: max_model_len
    assert check_stop(sequence([8]), None, EOS, 5) is None


def test_an_engine_without_speculation_has_the_null_proposer():
    engine = Engine(make_model("llama", torch.float32, "sdpa"), config=EngineConfig(block_size=4))
    proposer = engine.core.proposer
    assert isinstance(proposer, NullProposer) and proposer.kv_bytes_per_token(torch.float32) == 0
    drafts = []
    execute = engine.core.runner.execute

    def recording(batch):
        drafts.extend(s.num_drafts for s in batch.scheduled)
        return execute(batch)

    engine.core.runner.execute = recording
    engine.generate(random_prompts([5, 9], seed=1), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert drafts and not any(drafts) and proposer.num_tracked == 0
    assert engine.stats().spec_decode_num_drafts == 0 and engine.stats().compile_seconds == 0.0
