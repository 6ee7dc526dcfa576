"""vLLM's /tokenize and /detokenize, answered by the router's own tokenizer, off the event
loop (router/flow/tokenization.py)."""

from fastapi import APIRouter, Request

from router.http.body import json_body, read_json
from router.http.errors import check_model
from router.http.openai_types import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    parse_request,
)

routes = APIRouter()


@routes.post(
    "/tokenize",
    openapi_extra=json_body(TokenizeCompletionRequest, TokenizeChatRequest),
)
async def tokenize(request: Request):
    """A prompt, or messages with the chat template applied."""
    state = request.app.state
    body = await read_json(request)
    chat = isinstance(body, dict) and "messages" in body
    parsed = parse_request(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    check_model(parsed.model, state.settings.served_model)
    tokenizer, off_loop = state.tokenizer, state.tokenizing.run  # router/flow/tokenization.py
    if chat:
        ids = await off_loop(
            tokenizer.chat_ids,
            parsed.messages,
            parsed.add_generation_prompt,
            parsed.continue_final_message,
            parsed.add_special_tokens,
        )
    else:
        ids = await off_loop(tokenizer.text_ids, parsed.prompt, parsed.add_special_tokens)
    return {
        "count": len(ids),
        "max_model_len": state.pool.max_model_len,
        "tokens": ids,
        "token_strs": await off_loop(tokenizer.token_strs, ids)
        if parsed.return_token_strs
        else None,
    }


@routes.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
async def detokenize(request: Request):
    state = request.app.state
    parsed = parse_request(DetokenizeRequest, await read_json(request))
    check_model(parsed.model, state.settings.served_model)
    return {"prompt": await state.tokenizing.run(state.tokenizer.detokenize, parsed.tokens)}
