"""`SamplingParams(structured_outputs=...)` in the Engine, on the reference target: greedy outputs equal constrained
`generate`'s (every constraint kind, mixed with unconstrained requests in one batch), every speculative method equals
constrained plain decoding, sampled outputs validate, verifying a candidate under a grammar is lossless, the grammar
compiles off the step loop (other requests finish while one waits; abort while waiting frees everything), a bad
constraint is refused when added and a failed compile fails its request alone."""

from __future__ import annotations

import functools
import json
import re
import threading

import jsonschema
import pydantic
import pytest
import torch

from hf_accel import (Engine, EngineConfig, SamplingParams, SpeculativeConfig, StructuredOutput,
                      StructuredOutputsParams, reference)
from hf_accel.cache.kv_shape import KVShape
from hf_accel.engine.commit import Committer
from hf_accel.engine.model_runner import StepOutput
from hf_accel.engine.outputs import RequestTiming
from hf_accel.engine.scheduler import ScheduledSeq
from hf_accel.engine.sequence import Request, make_sequences
from hf_accel.engine import structured_requests
from hf_accel.structured.forced_spelling import forget_spellings
from hf_accel.structured.grammars import compile_constraint, compiler_for
from hf_accel.structured.matcher import TokenMatcher, apply_bitmask, fill_rows

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "color": {"enum": ["red", "green", "blue"]},
                                           "done": {"type": "boolean"}},
          "required": ["name", "color", "done"], "additionalProperties": False}
PROMPTS = ["# a config record\nrecord = ", "data = ", "x = 1\n", 'config = {"name": "x"}\nother = ']
CONSTRAINTS = [StructuredOutput(json=SCHEMA), StructuredOutput(regex=r"[a-z]{3}-[0-9]{2}"),
               StructuredOutput(choice=["import os", "pass"]), StructuredOutput(json_object=True),
               StructuredOutput(grammar='root ::= "(" [1-9] [0-9]* ("," [1-9] [0-9]*)* ")"')]
MAX_TOKENS = 40


class Pet(pydantic.BaseModel):
    kind: str = pydantic.Field(max_length=10)
    legs: int = pydantic.Field(ge=0, le=8)


@functools.lru_cache(maxsize=None)
def target():
    return reference.load("target")


def engine(speculative: SpeculativeConfig | None = None, **config) -> Engine:
    model, tokenizer = target()
    return Engine(model, tokenizer, config=EngineConfig(enforce_eager=True, **config), speculative=speculative)


def greedy(constraint: StructuredOutput | None, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs=constraint, **kwargs)


def constrained_generate(prompt: str, constraint: StructuredOutput) -> list[int]:
    model, tokenizer = target()
    inputs = tokenizer([prompt], return_tensors="pt", add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, structured_output=constraint, tokenizer=tokenizer,
                         do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def mask_rows(logits: torch.Tensor, matchers: list[TokenMatcher | None]) -> None:
    """Row i of `logits` masked in place to what `matchers[i]` allows next, as the engine's sampler masks the rows it
    processes: `fill_rows`, then `apply_bitmask` on the rows it restricts."""
    bitmask, rows = fill_rows(matchers, logits.shape[-1])
    if rows:
        apply_bitmask(logits, bitmask, rows)


def apply_bitmask_of(matcher: TokenMatcher, logits: torch.Tensor) -> None:
    mask_rows(logits, [matcher])


def assert_nothing_kept(eng: Engine) -> None:
    blocks = eng.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks and not eng.core.requests
    assert not eng.core.grammars.has_pending


def test_greedy_equals_constrained_generate_beside_unconstrained_requests():
    eng = engine()
    plain = [out.outputs[0].token_ids for out in eng.generate(PROMPTS, greedy(None))]
    for constraint in CONSTRAINTS:
        # each prompt constrained, batched with the same prompts unconstrained
        outs = eng.generate(PROMPTS + PROMPTS, [greedy(constraint)] * len(PROMPTS) + [greedy(None)] * len(PROMPTS))
        for prompt, out in zip(PROMPTS, outs):
            assert out.outputs[0].token_ids == constrained_generate(prompt, constraint), (constraint.kind, prompt)
        assert [out.outputs[0].token_ids for out in outs[len(PROMPTS):]] == plain
    assert_nothing_kept(eng)


def test_chunked_prefill_preemption_and_prefix_hits_keep_constrained_outputs():
    """Prompts computed in chunks, sequences preempted for blocks and recomputed, prompts found in the prefix cache:
    the matcher keeps its place (the tokens are the same), so outputs equal constrained `generate`'s."""
    model, _ = target()
    per_token = KVShape.from_config(model.config).bytes_per_token(torch.float32)
    eng = engine(kv_cache_memory=per_token * 96, max_model_len=96, block_size=4, max_num_batched_tokens=8,
                 max_num_seqs=4)
    constraint = StructuredOutput(json=SCHEMA)
    expected = [constrained_generate(prompt, constraint) for prompt in PROMPTS]
    for _ in range(2):  # the second round finds the prompts' blocks in the prefix cache
        outs = eng.generate(PROMPTS, greedy(constraint))
        assert [out.outputs[0].token_ids for out in outs] == expected
    stats = eng.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert_nothing_kept(eng)


def test_schemas_differing_in_property_order_get_their_own_grammars():
    """The grammar writes properties in the schema's order, so a schema with its keys reordered is another grammar
    (not the cached one of the first)."""
    reordered = {**SCHEMA, "properties": dict(reversed(list(SCHEMA["properties"].items())))}
    eng = engine()
    first, second = (eng.generate([PROMPTS[0]], greedy(StructuredOutput(json=schema)))[0].outputs[0].text
                     for schema in (SCHEMA, reordered))
    assert first.startswith('{"name"') and second.startswith('{"done"')


def test_outputs_match_their_constraint_and_stop_when_complete():
    eng = engine()
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True,
                            structured_outputs=StructuredOutput(json=SCHEMA))
    outs = eng.generate(PROMPTS, params)  # a complete constraint ends the output, even with ignore_eos
    for out in outs:
        sample = out.outputs[0]
        assert sample.finish_reason == "stop", sample
        jsonschema.validate(json.loads(sample.text), SCHEMA)
    [code] = eng.generate(["code = '"], greedy(StructuredOutput(regex=r"[a-z]{3}-[0-9]{2}")))
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", code.outputs[0].text)


def test_jump_forward_verifies_forced_tokens_and_changes_no_output():
    """Keys, punctuation and closing brackets the schema forces are verified as candidates: fewer steps, the same
    tokens, greedy and seeded sampling alike (the forced candidates are deterministic: lossless)."""
    outputs, steps = {}, {}
    for enabled in (False, True):
        eng = engine(structured_jump_forward=enabled)
        greedy_outs = eng.generate(PROMPTS, greedy(StructuredOutput(json=SCHEMA)))
        outputs[enabled] = [out.outputs[0].token_ids for out in greedy_outs]
        steps[enabled] = eng.stats().num_steps
        assert (eng.stats().jump_forward_tokens > 0) == enabled
        sampled = eng.generate(["pet = "], SamplingParams(max_tokens=48, seed=3, structured_outputs=StructuredOutput(
            json=Pet)))
        if sampled[0].outputs[0].finish_reason == "stop":
            Pet.model_validate_json(sampled[0].outputs[0].text)
        assert_nothing_kept(eng)
    assert outputs[True] == outputs[False]
    assert steps[True] < steps[False]


def test_greedy_requests_draft_forced_text_as_the_model_spelled_it_before():
    """A greedy request after another with the same schema drafts the forced keys and punctuation as the model wrote
    them the first time (`forced_spelling.py`): more of its forced tokens are kept, in fewer steps, and its output
    is the same. A seeded sampled request drafts as before (its draws stay the same from run to run)."""
    forget_spellings()  # as in a new process
    schema = {"type": "object", "properties": {"engine_spelling_kind": {"enum": ["red", "blue"]},
                                               "engine_spelling_size": {"type": "integer"}},
              "required": ["engine_spelling_kind", "engine_spelling_size"], "additionalProperties": False}
    eng = engine()
    kept, steps, outputs = [], [], []
    for _ in range(2):
        before = eng.stats()
        [out] = eng.generate(PROMPTS[:1], greedy(StructuredOutput(json=schema)))
        after = eng.stats()
        kept.append(after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens)
        steps.append(after.num_steps - before.num_steps)
        outputs.append(out.outputs[0].token_ids)
    assert outputs[0] == outputs[1] == constrained_generate(PROMPTS[0], StructuredOutput(json=schema))
    assert kept[1] > kept[0] and steps[1] < steps[0], (kept, steps)
    sampled = SamplingParams(max_tokens=32, seed=5, structured_outputs=StructuredOutput(json=schema))
    draws = [eng.generate(PROMPTS[:1], sampled)[0].outputs[0].token_ids for _ in range(2)]
    assert draws[0] == draws[1]
    assert_nothing_kept(eng)


def speculative_configs() -> dict[str, SpeculativeConfig]:
    model, _ = target()
    return {"ngram": SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1),
            "suffix": SpeculativeConfig("suffix", num_speculative_tokens=4),
            "medusa": SpeculativeConfig("medusa", model=reference.load_head("medusa")),
            "eagle3": SpeculativeConfig("eagle3", model=reference.load_head("eagle", model)),
            "draft": SpeculativeConfig("draft", model=reference.load("draft")[0], num_speculative_tokens=4)}


@pytest.mark.parametrize("method", ["ngram", "suffix", "medusa", "eagle3", "draft"])
def test_every_speculative_method_equals_constrained_plain_decoding(method):
    plain = engine()
    expected = [[out.outputs[0].token_ids for out in plain.generate(PROMPTS, greedy(c))] for c in CONSTRAINTS]
    spec = engine(speculative_configs()[method])
    got = [[out.outputs[0].token_ids for out in spec.generate(PROMPTS, greedy(c))] for c in CONSTRAINTS]
    assert got == expected
    assert spec.stats().spec_decode_num_draft_tokens > 0  # candidates were verified under the grammars
    assert_nothing_kept(spec)


def test_a_grammar_raising_while_candidates_are_verified_fails_its_request_alone(monkeypatch):
    """Greedy constrained candidates are verified together (one bitmask, one argmax): a grammar that raises there
    ends its own request; the others keep exactly their outputs."""
    params = [greedy(c) for c in CONSTRAINTS[:len(PROMPTS)]]
    expected = [out.outputs[0].token_ids for out in engine().generate(PROMPTS, params)]
    doomed = []
    fill = TokenMatcher.fill_drafts

    def faulty(self, drafts, bitmask, row):
        if drafts and not doomed:
            doomed.append(self)
        if doomed and doomed[0] is self:
            raise RuntimeError("the matcher broke")
        return fill(self, drafts, bitmask, row)

    monkeypatch.setattr(TokenMatcher, "fill_drafts", faulty)
    eng = engine(speculative_configs()["ngram"])
    outs = eng.generate(PROMPTS, params)
    failed = [i for i, out in enumerate(outs) if out.error is not None]
    assert len(failed) == 1 and "the matcher broke" in str(outs[failed[0]].error)
    assert [out.outputs[0].token_ids for i, out in enumerate(outs) if i not in failed] == \
        [ids for i, ids in enumerate(expected) if i not in failed]
    assert_nothing_kept(eng)


@pytest.mark.parametrize("method", [None, "suffix"])
def test_sampled_outputs_validate_and_are_seeded(method):
    eng = engine(None if method is None else speculative_configs()[method])
    params = SamplingParams(max_tokens=48, temperature=1.0, seed=7, n=3, structured_outputs=StructuredOutput(json=Pet))
    outs = eng.generate(["pet = ", "# the data of one animal\nanimal = "], params)
    for out in outs:
        for sample in out.outputs:
            if sample.finish_reason == "stop":
                Pet.model_validate_json(sample.text)
            else:  # max_tokens first: a valid prefix, unfinished
                assert sample.finish_reason == "length"
    assert sum(s.finish_reason == "stop" for out in outs for s in out.outputs) >= 4
    if method is not None:  # the suffix cache learned from these outputs: other candidates, other draws
        return
    again = eng.generate(["pet = ", "# the data of one animal\nanimal = "], params)
    assert [[s.token_ids for s in o.outputs] for o in again] == [[s.token_ids for s in o.outputs] for o in outs]


def test_verifying_a_sampled_candidate_under_a_grammar_is_lossless():
    """The first token emitted after verifying one candidate is distributed as the target's distribution masked by
    the grammar, whether the candidate is allowed or not."""
    model, tokenizer = target()
    vocab = model.get_output_embeddings().weight.shape[0]
    choices = ["ab", "cd", "ef", "gh"]
    compiled = compile_constraint(StructuredOutput(choice=choices), compiler_for(tokenizer, vocab, None))
    request = Request("r", None, [5, 6, 7], SamplingParams(max_tokens=8, temperature=1.0, seed=0), 0,
                      RequestTiming(0.0))
    make_sequences(request, lambda params: None)
    seq = request.sequences[0]
    seq.grammar, seq.num_computed_tokens = TokenMatcher(compiled), 2
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    masked = logits[0].clone()[None]
    apply_bitmask_of(TokenMatcher(compiled), masked)
    firsts = set(torch.isfinite(masked[0]).nonzero().flatten().tolist())  # tokens that start a choice
    assert 4 <= len(firsts) < 20
    target_probs = torch.softmax(logits[0][sorted(firsts)], dim=-1)
    committer = Committer(set(), 64, lambda request, error: pytest.fail(str(error)))
    allowed, forbidden = min(firsts), int(logits[0].argmax())
    assert forbidden not in firsts
    for candidate in (allowed, forbidden):
        out = StepOutput(logits, None, [ScheduledSeq(seq, 2, 1, [candidate])], [0])
        counts = dict.fromkeys(sorted(firsts), 0)
        for _ in range(2000):
            counts[committer._verify(out)[0][0]] += 1  # a KeyError would be a token the grammar forbids
        frequencies = torch.tensor(list(counts.values()), dtype=torch.float) / 2000
        assert torch.allclose(frequencies, target_probs, atol=0.05), (candidate, frequencies, target_probs)


def test_the_grammar_compiles_off_the_loop_and_a_waiting_request_can_be_aborted(monkeypatch):
    release = threading.Event()
    compile_grammar = structured_requests._compile

    def slow(key, compiler):
        release.wait(30)
        return compile_grammar(key, compiler)

    monkeypatch.setattr(structured_requests, "_compile", slow)
    eng = engine()
    eng.add_request(PROMPTS[0], greedy(StructuredOutput(json=SCHEMA)), request_id="waits")
    eng.add_request(PROMPTS[1], greedy(StructuredOutput(regex="[a-z]+")), request_id="aborted")
    eng.add_request(PROMPTS[2], greedy(None), request_id="free")
    finished = {}
    for _ in range(200):
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
        if "free" in finished:
            break
    assert set(finished) == {"free"}  # decoded to its end while both grammars were compiling
    eng.abort("aborted")
    eng.step()
    assert "aborted" not in eng.core.requests and "waits" in eng.core.requests
    release.set()
    while eng.has_unfinished_requests():
        for out in eng.step():
            finished[out.request_id] = out
    assert "aborted" not in finished
    assert finished["waits"].outputs[0].token_ids == constrained_generate(PROMPTS[0], StructuredOutput(json=SCHEMA))
    assert_nothing_kept(eng)


def test_the_worker_compiles_what_admission_parsed(monkeypatch):
    """A constraint is parsed once, when its request is added: the worker thread runs xgrammar's compile alone,
    with no Python-side parsing that would take the GIL from the stepping thread."""
    from hf_accel.structured import grammars

    parsed = []
    parse = grammars.parse_constraint
    monkeypatch.setattr(grammars, "parse_constraint", lambda constraint: parsed.append(constraint) or parse(constraint))
    schema = {**SCHEMA, "title": "parsed once"}  # a constraint no other test parsed
    eng = engine()
    out = eng.generate(PROMPTS[:2], [greedy(StructuredOutput(json=schema))] * 2)
    assert len(parsed) == 1 and [o.error for o in out] == [None, None]
    assert [o.outputs[0].token_ids for o in out] == [constrained_generate(p, StructuredOutput(json=schema))
                                                     for p in PROMPTS[:2]]
    assert_nothing_kept(eng)


def test_a_failed_compile_fails_its_request_alone(monkeypatch):
    def broken(key, compiler):
        raise ValueError("`structured_outputs`: the backend broke")

    monkeypatch.setattr(structured_requests, "_compile", broken)
    eng = engine()
    bad, good = eng.generate(PROMPTS[:2], [greedy(StructuredOutput(regex="[a-z]+")), greedy(None)])
    assert bad.error is not None and "the backend broke" in str(bad.error)
    assert bad.outputs[0].finish_reason == "error" and good.outputs[0].finish_reason == "length"
    assert_nothing_kept(eng)


def test_bad_constraints_are_refused_when_added():
    eng = engine()
    with pytest.raises(ValueError, match=r"`structured_outputs`: the `regex` constraint cannot be compiled"):
        eng.add_request("x", greedy(StructuredOutput(regex="a(b")))
    with pytest.raises(ValueError, match=r"`structured_outputs`: the `json` constraint .*strin"):
        eng.add_request("x", greedy(StructuredOutput(json={"type": "strin"})))
    with pytest.raises(TypeError, match="`structured_outputs` must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": SCHEMA})
    model, tokenizer = target()
    without_tokenizer = Engine(model, config=EngineConfig(enforce_eager=True))
    with pytest.raises(ValueError, match="needs the engine's tokenizer"):
        without_tokenizer.add_request([5, 6], greedy(StructuredOutput(regex="a")))
    assert not eng.core.requests and not without_tokenizer.core.requests


def test_pydantic_constraint_becomes_plain_data():
    """A Pydantic class is kept as its schema, so the parameters pickle to the engine-core process."""
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=Pet))
    assert params.structured_outputs.json == Pet.model_json_schema()
    assert StructuredOutputsParams is StructuredOutput


@pytest.mark.compiled
def test_compiled_engine_equals_the_eager_one():
    """The mask is applied to the compiled step's logits on the host: nothing in the graph changes."""
    model, tokenizer = target()
    compiled = Engine(model, tokenizer, config=EngineConfig(max_num_seqs=4))
    assert compiled.core.runner.forward.compiled
    eager = engine(max_num_seqs=4)
    for constraint in CONSTRAINTS[:3]:
        got = [out.outputs[0].token_ids for out in compiled.generate(PROMPTS, greedy(constraint))]
        assert got == [out.outputs[0].token_ids for out in eager.generate(PROMPTS, greedy(constraint))]


def test_mask_rows_masks_live_rows_and_leaves_the_others_across_steps():
    """One batch: an unconstrained row, a terminated matcher's row (it allows everything) and live matchers in other
    places of the grammar; each live row keeps exactly what its matcher allows, the others are untouched, and the
    bitmask reused by the next step of the same size (with other rows where) never carries a row over."""
    model, tokenizer = target()
    compiled = compile_constraint(StructuredOutput(json=SCHEMA), compiler_for(tokenizer, model.config.vocab_size, None))
    vocab = model.config.vocab_size

    def matcher_after(text: str) -> TokenMatcher:
        matcher = TokenMatcher(compiled)
        assert matcher.follow(tokenizer.encode(text, add_special_tokens=False))
        return matcher

    def allowed(matcher: TokenMatcher) -> torch.Tensor:  # [vocab] bool, one matcher alone
        logits = torch.zeros(1, vocab)
        mask_rows(logits, [matcher])
        return logits[0] == 0

    done = matcher_after('{"name": "a", "color": "red", "done": true}')
    assert done.advance(tokenizer.eos_token_id) and done.is_terminated
    places = ['{"name": "Jo', '{"name": "a", "color": "', '{"name": "a", "color": "red", "done": ']
    live = [matcher_after(text) for text in places]
    for batch in ([None, done, *live], live[1:], [live[2], None, live[0], done, live[1]]):
        logits = torch.randn(len(batch), vocab)
        masked = logits.clone()
        mask_rows(masked, batch)
        for row, matcher in enumerate(batch):
            if matcher is None or matcher is done:
                assert torch.equal(masked[row], logits[row])
            else:
                keep = allowed(matcher)
                assert 0 < keep.sum() < vocab
                assert torch.equal(masked[row][keep], logits[row][keep])
                assert masked[row][~keep].eq(float("-inf")).all()
