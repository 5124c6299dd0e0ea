"""`ServedAdapters`: the LoRA adapters a server serves by name, the name a request's `model` selects
(`hf-accel serve --lora-modules name=path`, and at run time `POST /v1/load_lora_adapter` /
`/v1/unload_lora_adapter` with `--allow-runtime-lora`).

Rules:
- names are unique and never the base model's; each adapter loaded gets a fresh `lora_int_id` (an id names one
  folder for the engine's life, so a name loaded again from another folder is another adapter to the engine);
- loading reads and checks the folder first (`EngineClient.add_lora`): one that cannot be served is a 400 naming the
  problem, and nothing is registered;
- unloading takes the name away at once (new requests naming it get 404), waits for the HTTP requests still using the
  adapter, then drops it from the engine (`remove_lora`);
- a load with `replace` (vLLM's `load_inplace`) serves a served name from a new folder (or the same folder read
  again): new requests get the new adapter as soon as it is read, requests already running finish with the one they
  started with, which is then dropped as an unload drops it. Unlike vLLM, which reloads under the same id (running
  requests switch weights mid-answer, prefix-cache blocks of the old weights stay), the new weights are a new
  adapter to the engine: nothing computed with the old ones is reused;
- the registry is touched on the event loop only; the folder is read in a worker thread.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Mapping

from ..lora.config import LoRARequest
from .errors import APIError
from .served_engine import ServedEngine


class ServedAdapters:
    """The adapters served over `engine` beside the base model `base_name`."""

    def __init__(self, engine: ServedEngine, base_name: str):
        self.engine, self.base_name = engine, base_name
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._in_flight: Counter[int] = Counter()  # lora_int_id -> HTTP requests using it
        self._drained: dict[int, asyncio.Event] = {}  # lora_int_id being unloaded -> set once nothing uses it
        self._retiring: set[asyncio.Task] = set()  # adapters replaced in place, dropped once nothing uses them

    @classmethod
    def at_start(cls, engine: ServedEngine, base_name: str, modules: Mapping[str, str]) -> ServedAdapters:
        """The adapters served from the start (name -> folder); ValueError naming the first that cannot be served
        (the server does not start)."""
        adapters = cls(engine, base_name)
        for name, path in modules.items():
            try:
                adapters.load(name, path)
            except APIError as error:  # at start: the reason, as a plain error
                raise ValueError(error.message) from error.__cause__
        return adapters

    def __iter__(self):
        return iter(self._by_name.values())

    def find(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def load(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter folder `path` as `name` (reads it here: call from a worker thread, or at start-up);
        APIError 400 when the name is taken or the folder cannot be served."""
        request = self._new_request(name, path)
        try:
            self.engine.add_lora(request)
        except (ValueError, TypeError, OSError) as error:
            raise unservable(name, error) from error
        self._register(request)
        return request

    async def load_async(self, name: str, path: str, replace: bool = False) -> LoRARequest:
        """`load` with the folder read in a worker thread; with `replace`, a served `name` is served from `path`
        from now on (the adapter it named is dropped once the requests using it are done)."""
        request = self._new_request(name, path, replace)
        try:
            await asyncio.to_thread(self.engine.add_lora, request)
        except (ValueError, TypeError, OSError) as error:
            raise unservable(name, error) from error
        except BaseException:  # cancelled while reading: the engine may hold it, under no name
            self.engine.remove_lora(request.lora_int_id)
            raise
        try:
            replaced = self._register(request, replace)  # checks the name again: another load may have taken it
        except APIError:
            self.engine.remove_lora(request.lora_int_id)
            raise
        if replaced is not None:
            task = asyncio.create_task(self._retire(replaced))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        return request

    async def unload(self, name: str) -> None:
        """Stop serving `name` (404 when it is not served), wait until no request uses it, then drop it from the
        engine."""
        request = self._by_name.pop(name, None)
        if request is None:
            raise APIError(404, f"The LoRA adapter `{name}` is not loaded.", param="lora_name",
                           code="lora_adapter_not_found", error_type="not_found_error")
        await self._retire(request)

    async def _retire(self, request: LoRARequest) -> None:
        """Wait until no request uses `request`'s adapter (served under no name now), then drop it from the engine."""
        lora_id = request.lora_int_id
        try:
            if self._in_flight[lora_id]:
                drained = self._drained[lora_id] = asyncio.Event()
                await drained.wait()
        finally:  # also when the wait is cancelled (server shutdown): the engine lets go once nothing pins it
            self._drained.pop(lora_id, None)
            self.engine.remove_lora(lora_id)

    def hold(self, request: LoRARequest | None) -> None:
        """An HTTP request starts using `request`'s adapter (nothing for the base)."""
        if request is not None:
            self._in_flight[request.lora_int_id] += 1

    def release(self, request: LoRARequest | None) -> None:
        """The HTTP request that held `request`'s adapter is done with it."""
        if request is None:
            return
        lora_id = request.lora_int_id
        self._in_flight[lora_id] -= 1
        if not self._in_flight[lora_id]:
            del self._in_flight[lora_id]
            drained = self._drained.pop(lora_id, None)
            if drained is not None:
                drained.set()

    def _new_request(self, name: str, path: str, replace: bool = False) -> LoRARequest:
        self._check_name(name, replace)
        if not isinstance(path, str) or not path:
            raise APIError(400, f"`lora_path` must be a non-empty string, got {path!r}", param="lora_path",
                           code="invalid_value")
        return LoRARequest(name, next(self._ids), path)

    def _register(self, request: LoRARequest, replace: bool = False) -> LoRARequest | None:
        """Serve `request` under its name; returns the adapter it replaces (`replace`), if any."""
        self._check_name(request.lora_name, replace)
        replaced = self._by_name.get(request.lora_name)
        self._by_name[request.lora_name] = request
        return replaced

    def _check_name(self, name: str, replace: bool = False) -> None:
        if not isinstance(name, str) or not name:
            raise APIError(400, f"`lora_name` must be a non-empty string, got {name!r}", param="lora_name",
                           code="invalid_value")
        if name == self.base_name:
            raise APIError(400, f"The name `{name}` is the base model's; pick another.", param="lora_name",
                           code="lora_adapter_exists")
        if name in self._by_name and not replace:
            raise APIError(400, f"The LoRA adapter `{name}` is already served; unload it first, pick another name, "
                                "or set `load_inplace` to true to serve the new folder under it.", param="lora_name",
                           code="lora_adapter_exists")


def unservable(name: str, error: BaseException) -> APIError:
    """400: the adapter folder of `name` cannot be served (`error` says why)."""
    return APIError(400, f"The LoRA adapter `{name}` cannot be served: {error}", param="lora_path",
                    code="invalid_lora_adapter")
