"""LoRA adapters behind the OpenAI-compatible server: `hf-accel serve --lora-modules name=path` (engine-core process),
the request's `model` choosing the adapter (each answer equals its adapter's merged model, peft `merge_and_unload`),
`/v1/models` listing base and adapters, 404 for an unknown model, runtime `POST /v1/load_lora_adapter` /
`/v1/unload_lora_adapter` behind `--allow-runtime-lora` and the API key (a bad folder is a 400 naming the problem and
loads nothing; an unload waits for the requests using the adapter, none of which fails), and vLLM's
`lora_requests_info` metric."""

import asyncio
import copy
import time

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from hf_accel import Engine, EngineConfig, LoRAConfig
from hf_accel.server import command, create_app, serve_in_thread

from engine_helpers import HeldSteps
from server_helpers import load_target, served_client

peft = pytest.importorskip("peft")

PROMPT = [5, 9, 17, 33, 2, 71, 8, 140, 12]
MAX_TOKENS = 8
KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADAPTERS = {  # name -> peft LoraConfig arguments
    "ft-attn": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "ft-mlp": {"r": 4, "lora_alpha": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "ft-late": {"r": 16, "lora_alpha": 16, "target_modules": ["o_proj", "down_proj"]},
}


@pytest.fixture(scope="module")
def target():
    model, tokenizer = load_target()
    return model, tokenizer


@pytest.fixture(scope="module")
def adapters(target, tmp_path_factory):
    """name -> (folder, that adapter's greedy tokens on PROMPT, from its merged model)."""
    base, _ = target
    folder = tmp_path_factory.mktemp("adapters")
    made = {}
    for seed, (name, settings) in enumerate(ADAPTERS.items(), start=1):
        torch.manual_seed(seed)
        tuned = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **settings))
        tuned.save_pretrained(folder / name)
        made[name] = (str(folder / name), greedy(tuned.merge_and_unload().eval()))
    return made


@pytest.fixture(scope="module")
def big_rank_adapter(target, tmp_path_factory):
    """An adapter of rank 32, over the served limit of 16."""
    base, _ = target
    folder = tmp_path_factory.mktemp("big") / "rank32"
    peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=32, target_modules=["q_proj"])).save_pretrained(folder)
    return str(folder)


def greedy(model) -> list[int]:
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                         do_sample=False, attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
    return out[0, len(PROMPT):].tolist()


def complete(client: TestClient, model: str | None, headers=AUTH) -> dict:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if model is not None:
        body["model"] = model
    return client.post("/v1/completions", json=body, headers=headers)


def test_serve_lora_modules_then_load_and_unload_at_run_time(monkeypatch, target, adapters, big_rank_adapter,
                                                             tmp_path):
    base_tokens = greedy(target[0])
    assert len({tuple(base_tokens), *(tuple(tokens) for _, tokens in adapters.values())}) == 4  # the test can fail
    (attn_path, attn_tokens), (mlp_path, mlp_tokens), (late_path, late_tokens) = adapters.values()
    argv = ["--lora-modules", f"ft-attn={attn_path}", f'{{"name": "ft-mlp", "path": "{mlp_path}"}}',
            "--max-lora-rank", "16", "--max-loras", "2", "--allow-runtime-lora", "--api-key", KEY]
    with served_client(monkeypatch, argv) as (_, client):
        models = client.get("/v1/models", headers=AUTH).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [
            (command.REFERENCE_NAME, None), ("ft-attn", command.REFERENCE_NAME), ("ft-mlp", command.REFERENCE_NAME)]
        for model, want in [(None, base_tokens), ("ft-attn", attn_tokens), ("ft-mlp", mlp_tokens),
                            (command.REFERENCE_NAME, base_tokens)]:
            answer = complete(client, model).json()
            assert answer["choices"][0]["token_ids"] == want, model
            assert answer["model"] == (model or command.REFERENCE_NAME)
        missing = complete(client, "ft-late")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert "ft-attn" in missing.json()["error"]["message"]

        # runtime load: behind the key; bad folders are 400s naming the problem, and load nothing
        load = {"lora_name": "ft-late", "lora_path": late_path}
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 401
        for bad_path, reason in [(big_rank_adapter, "rank"), (str(tmp_path / "nowhere"), "adapter_config.json")]:
            refused = client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": bad_path},
                                  headers=AUTH)
            assert refused.status_code == 400 and reason in refused.json()["error"]["message"]
            assert refused.json()["error"]["code"] == "invalid_lora_adapter"
        taken = client.post("/v1/load_lora_adapter", json={"lora_name": "ft-attn", "lora_path": late_path},
                            headers=AUTH)
        assert taken.status_code == 400 and taken.json()["error"]["code"] == "lora_adapter_exists"
        loaded = client.post("/v1/load_lora_adapter", json=load, headers=AUTH)
        assert loaded.status_code == 200 and "ft-late" in loaded.text
        assert complete(client, "ft-late").json()["choices"][0]["token_ids"] == late_tokens
        assert [m["id"] for m in client.get("/v1/models", headers=AUTH).json()["data"]][-1] == "ft-late"
        # three adapters through two slots, then the base: each still its own
        for model, want in [("ft-mlp", mlp_tokens), ("ft-attn", attn_tokens), ("ft-late", late_tokens),
                            ("bad", None)]:
            answer = complete(client, model)
            assert answer.status_code == 404 if want is None else answer.json()["choices"][0]["token_ids"] == want

        metrics = client.get("/metrics").text
        assert 'hf_accel:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' \
            in metrics

        unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "ft-attn"}, headers=AUTH)
        assert unloaded.status_code == 200
        assert complete(client, "ft-attn").status_code == 404
        again = client.post("/v1/unload_lora_adapter", json={"lora_name": "ft-attn"}, headers=AUTH)
        assert again.status_code == 404 and again.json()["error"]["code"] == "lora_adapter_not_found"
        # the name again, from another folder: another adapter to the engine
        reloaded = client.post("/v1/load_lora_adapter", json={"lora_name": "ft-attn", "lora_path": late_path},
                               headers=AUTH)
        assert reloaded.status_code == 200
        assert complete(client, "ft-attn").json()["choices"][0]["token_ids"] == late_tokens


def test_runtime_routes_are_off_without_the_flag(monkeypatch, adapters):
    attn_path, _ = adapters["ft-attn"]
    with served_client(monkeypatch, ["--lora-modules", f"ft-attn={attn_path}", "--enforce-eager",
                                     "--no-engine-process"]) as (_, client):
        assert client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": attn_path}).status_code \
            == 404
        assert [m["id"] for m in client.get("/v1/models").json()["data"]][-1] == "ft-attn"


def test_a_bad_adapter_at_start_fails_the_start(monkeypatch, big_rank_adapter):
    apps = []

    class Server:
        def __init__(self, config):
            self.config, self.should_exit = config, False

        def run(self) -> None:
            apps.append(self.config.app)
            with TestClient(self.config.app):
                deadline = time.monotonic() + 600
                while self.config.app.state.load.status == "loading" and time.monotonic() < deadline:
                    time.sleep(0.05)

    monkeypatch.setattr(command.uvicorn, "Server", Server)
    argv = ["--lora-modules", f"big={big_rank_adapter}", "--max-lora-rank", "16", "--no-engine-process"]
    assert command.main(argv) == 1
    assert "rank" in str(apps[0].state.load.error) and "`big`" in str(apps[0].state.load.error)


def eager_lora_app(model, tokenizer, modules: dict[str, str]):
    """An eager two-slot LoRA engine (the compiled LoRA step is test_engine_lora.py's) and its runtime-LoRA app."""
    engine = Engine(copy.deepcopy(model), tokenizer, config=EngineConfig(max_num_seqs=8, enforce_eager=True),
                    lora=LoRAConfig(max_loras=2))
    return engine, create_app(engine, tokenizer, "base", lora_modules=modules, allow_runtime_lora=True)


async def stream_reasons(client: openai.AsyncOpenAI, model: str, first: asyncio.Event) -> list[str | None]:
    """A 64-token stream on `model`: its chunks' finish reasons (`first` set at its first chunk)."""
    chunks = await client.completions.create(model=model, prompt=PROMPT, max_tokens=64, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    reasons = []
    async for chunk in chunks:
        first.set()
        reasons += [choice.finish_reason for choice in chunk.choices]
    return reasons


def test_unload_under_load_waits_for_running_requests_and_none_fails(target, adapters, monkeypatch):
    """Streams on an adapter run while it is unloaded: every one finishes whole, the unload answers only after
    them, and a load serves its first request right after the call (bench_lora.py times it: the issue's 2 s; here
    a loose bound, the machine being shared with other tests). Eager steps: the compiled LoRA step is
    test_engine_lora.py's."""
    attn_path, attn_tokens = adapters["ft-attn"]
    mlp_path, mlp_tokens = adapters["ft-mlp"]
    engine, app = eager_lora_app(*target, {"ft-attn": attn_path})
    steps = HeldSteps(engine, monkeypatch, held=False)

    async def run(url: str) -> None:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            started = [asyncio.Event() for _ in range(6)]
            running = [asyncio.ensure_future(stream_reasons(client, "ft-attn", first)) for first in started]
            await asyncio.gather(*(first.wait() for first in started))  # every stream has its first token
            steps.hold()  # none can finish until the unload is seen waiting for them
            try:
                assert engine.stats().running_lora_adapters["ft-attn"] > 0
                unload = asyncio.ensure_future(client.post("/unload_lora_adapter", cast_to=str,
                                                           body={"lora_name": "ft-attn"}))
                await asyncio.sleep(0.3)
                assert not unload.done()  # it waits for the running requests
            finally:
                steps.release()
            assert "removed" in await unload
            # it answered once they had left the engine: none was cut short
            assert "ft-attn" not in engine.stats().running_lora_adapters
            assert all(reasons[-1] == "length" for reasons in await asyncio.gather(*running))
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="ft-attn", prompt=PROMPT, max_tokens=2)

            started = time.monotonic()
            await client.post("/load_lora_adapter", cast_to=str, body={"lora_name": "ft-mlp", "lora_path": mlp_path})
            answer = await client.completions.create(model="ft-mlp", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                     temperature=0, extra_body={"ignore_eos": True,
                                                                                "return_token_ids": True})
            assert time.monotonic() - started < 10.0
            assert answer.choices[0].model_extra["token_ids"] == mlp_tokens

    with serve_in_thread(app) as url:
        asyncio.run(run(url))
    assert engine.core.adapters.slots.num_pinned == 0 and engine.core.blocks.pool.num_used_blocks == 0


def test_load_inplace_serves_the_new_folder_and_lets_running_requests_finish_on_the_old(target, adapters,
                                                                                         monkeypatch):
    """vLLM's `load_inplace`: streams on a name run while the name is loaded again from another folder; the load
    answers at once, new requests get the new adapter, the streams finish whole, and the old adapter then leaves the
    engine's memory. Without `load_inplace` a served name is a 400 that names the switch."""
    attn_path, attn_tokens = adapters["ft-attn"]
    mlp_path, mlp_tokens = adapters["ft-mlp"]
    engine, app = eager_lora_app(*target, {"ft": attn_path})
    steps = HeldSteps(engine, monkeypatch, held=False)

    async def run(url: str) -> None:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            async def tokens() -> list[int]:
                answer = await client.completions.create(model="ft", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                         temperature=0, extra_body={"ignore_eos": True,
                                                                                    "return_token_ids": True})
                return answer.choices[0].model_extra["token_ids"]

            assert await tokens() == attn_tokens
            with pytest.raises(openai.BadRequestError, match="load_inplace"):
                await client.post("/load_lora_adapter", cast_to=str, body={"lora_name": "ft", "lora_path": mlp_path})
            started = [asyncio.Event() for _ in range(4)]
            running = [asyncio.ensure_future(stream_reasons(client, "ft", first)) for first in started]
            await asyncio.gather(*(first.wait() for first in started))
            steps.hold()  # the streams cannot finish before the load answers
            try:
                await client.post("/load_lora_adapter", cast_to=str,
                                  body={"lora_name": "ft", "lora_path": mlp_path, "load_inplace": True})
                assert not any(task.done() for task in running)  # answered without waiting for them
            finally:
                steps.release()
            assert await tokens() == mlp_tokens
            assert all(reasons[-1] == "length" for reasons in await asyncio.gather(*running))
            for _ in range(100):  # the old adapter leaves once its last request is done (the engine's next step)
                if len(engine.core.adapters.adapters) == 1:
                    break
                await asyncio.sleep(0.05)
            assert len(engine.core.adapters.adapters) == 1 and await tokens() == mlp_tokens

    with serve_in_thread(app) as url:
        asyncio.run(run(url))
    assert engine.core.adapters.slots.num_pinned == 0 and engine.core.blocks.pool.num_used_blocks == 0


def test_lora_flags_are_checked():
    parser = command.build_parser()

    def spec(*argv):
        return command.engine_spec(parser, parser.parse_args(list(argv)))

    assert spec().lora is None
    assert spec("--enable-lora").lora == LoRAConfig()
    assert spec("--lora-modules", "a=/x", "--max-loras", "40").lora == LoRAConfig(max_loras=40, max_cpu_loras=40)
    assert spec("--allow-runtime-lora", "--max-lora-rank", "8").lora.max_lora_rank == 8
    assert spec("--enable-lora", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}').lora
    for argv in (["--max-loras", "2"], ["--enable-lora", "--max-loras", "0"],
                 ["--enable-lora", "--speculative-config", '{"method": "medusa", "model": "/nowhere"}']):
        with pytest.raises(SystemExit):
            spec(*argv)
    assert command.parse_lora_modules(parser, ["a=/x", '{"name": "b", "path": "/y=z"}']) == {"a": "/x", "b": "/y=z"}
    for bad in (["a"], ["=/x"], ["a=/x", "a=/y"], ['{"name": "a"}']):
        with pytest.raises(SystemExit):
            command.parse_lora_modules(parser, bad)


def test_a_stream_whose_client_left_before_its_first_event_still_lets_go_of_its_adapter():
    """Starlette cancels a streamed body when the client is gone, possibly before the generator started (whose
    `finally` then never runs): the response itself closes the engine requests, so the adapter's in-flight count
    drops and an unload does not wait forever."""
    from hf_accel.server.streaming import ClosingStreamingResponse

    closed = []

    async def events():
        yield "data: {}\n\n"

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        raise OSError("the client is gone")

    response = ClosingStreamingResponse(events(), lambda: closed.append(True), media_type="text/event-stream")
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "path": "/",
             "headers": []}
    with pytest.raises(OSError):
        asyncio.run(response(scope, receive, send))
    assert closed == [True]
