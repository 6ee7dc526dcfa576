"""OpenAI response bodies for the two endpoints, streamed (SSE chunks) and whole.

Chat and completions differ only in object names and in how a choice holds its text, so one
`ResponseFormat` per endpoint carries those differences and the rest is shared.
"""

import json
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def body(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class ResponseFormat:
    object_whole: str
    object_chunk: str

    def __init__(self, response_id: str, model: str) -> None:
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())

    def whole(self, text: str, finish_reason: str, usage: Usage) -> dict:
        return self._envelope(
            self.object_whole, [self.whole_choice(text, finish_reason)], usage=usage.body()
        )

    def chunk(self, text: str, finish_reason: str | None, first: bool) -> str:
        choice = self.chunk_choice(text, finish_reason, first)
        return sse(self._envelope(self.object_chunk, [choice]))

    def usage_chunk(self, usage: Usage) -> str:
        return sse(self._envelope(self.object_chunk, [], usage=usage.body()))

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {
            "id": self.response_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def whole_choice(self, text: str, finish_reason: str) -> dict:
        raise NotImplementedError

    def chunk_choice(self, text: str, finish_reason: str | None, first: bool) -> dict:
        raise NotImplementedError


class ChatFormat(ResponseFormat):
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def whole_choice(self, text: str, finish_reason: str) -> dict:
        return {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }

    def chunk_choice(self, text: str, finish_reason: str | None, first: bool) -> dict:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


class CompletionFormat(ResponseFormat):
    object_whole = "text_completion"
    object_chunk = "text_completion"

    def whole_choice(self, text: str, finish_reason: str) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, text: str, finish_reason: str | None, first: bool) -> dict:
        return self.whole_choice(text, finish_reason)


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")
