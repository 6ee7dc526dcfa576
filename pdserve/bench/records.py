"""What the client saw of one request: the raw timings every metric is computed from."""

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """One streamed request. Times are seconds; `ttft` and `e2e` count from `send_time`.

    `output_chunks` counts the streamed token chunks (see bench.client) and `output_text` is their
    text (the reply a conversation sends back in its next turn); `usage` is the server's `usage`
    object from the final chunk, when it sent one. A failed request has an `error` and keeps
    whatever timings it got before failing. `conversation` and `turn` (0 for the first) are set by
    the conversation workload; `cacheable_tokens` (the prompt tokens an infinite prefix cache
    would hold, see bench.infinite_cache) by workloads where it is computable.
    """

    prompt_tokens: int  # the workload's count (exact with a tokenizer, else approximate)
    max_tokens: int
    send_time: float = 0.0  # time.perf_counter() just before the HTTP request went out
    ttft: float | None = None  # send -> first chunk with generated text
    itl: list[float] = field(default_factory=list)  # gaps between consecutive token chunks
    e2e: float | None = None  # send -> last token chunk
    output_chunks: int = 0
    error: str | None = None
    usage: dict | None = None
    output_text: str = ""
    conversation: int | None = None
    turn: int | None = None
    cacheable_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        """Generated tokens: the server's `completion_tokens` if reported, else token chunks."""
        if self.usage and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"])
        return self.output_chunks

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the server served from its prefix cache; None when its usage does not
        say (`usage.prompt_tokens_details.cached_tokens` absent)."""
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return None if cached is None else int(cached)

    @property
    def input_tokens(self) -> int:
        """Prompt tokens: the server's `prompt_tokens` if reported, else the workload's count."""
        if self.usage and self.usage.get("prompt_tokens") is not None:
            return int(self.usage["prompt_tokens"])
        return self.prompt_tokens

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); undefined (None) for fewer than 2 tokens."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)
