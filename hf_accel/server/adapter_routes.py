"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (vLLM's runtime LoRA routes, served only with
`--allow-runtime-lora` and behind the API key when one is set): the adapter a load names serves as soon as the call
returns; an unload returns once no request uses the adapter any more."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from .protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from .state import ServerState, server_state

router = APIRouter()


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, server: ServerState = Depends(server_state)) -> str:
    """Serve `lora_path` as `lora_name`; 400 naming what is wrong (a name taken without `load_inplace`, a folder
    that cannot be served), and then nothing is loaded. With `load_inplace`, requests already running on the name
    finish with the adapter they started with."""
    await server.adapters.load_async(body.lora_name, body.lora_path, replace=body.load_inplace)
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, server: ServerState = Depends(server_state)) -> str:
    """Stop serving `lora_name` (404 when it is not served): new requests naming it get 404 at once; returns once
    the requests that use it have finished."""
    await server.adapters.unload(body.lora_name)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
