"""What the client saw of one request: the raw timings every metric is computed from."""

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """One streamed request. Times are seconds; `ttft` and `e2e` count from `send_time`.

    `output_chunks` counts the streamed token chunks (see bench.client); `usage` is the server's
    `usage` object from the final chunk, when it sent one. A failed request has an `error` and
    keeps whatever timings it got before failing.
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
    def cached_tokens(self) -> int:
        """Prompt tokens the server served from its prefix cache (its usage says; else 0)."""
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

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
