"""`POST /tokenize` and `POST /detokenize` in vLLM's request and response shapes."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from .errors import APIError
from .protocol import DetokenizeRequest, TokenizeRequest
from .responses import DetokenizeResponse, TokenizeResponse
from .state import ServerState, server_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, server: ServerState = Depends(server_state)) -> TokenizeResponse:
    """`{count, max_model_len, tokens, token_strs}` of a prompt, or of chat messages through the chat template."""
    server.model_adapter(body.model)  # adapters share the base's tokenizer
    if body.messages is not None:
        text = server.chat_prompt([m.template_dict() for m in body.messages], body.add_generation_prompt)
    else:
        text = body.prompt
    tokens = server.encode(text, add_special_tokens=body.add_special_tokens)
    strs = server.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=server.engine.max_model_len, tokens=tokens,
                            token_strs=strs)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, server: ServerState = Depends(server_state)) -> DetokenizeResponse:
    """`{prompt}`: the text of `tokens`."""
    server.model_adapter(body.model)  # adapters share the base's tokenizer
    vocab_size = len(server.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"`tokens` must be ids in [0, {vocab_size}), got {bad[:8]}", param="tokens",
                       code="invalid_value")
    return DetokenizeResponse(prompt=server.tokenizer.decode(body.tokens))
