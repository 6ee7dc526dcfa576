"""OpenAI response bodies for the two endpoints, streamed (SSE chunks) and whole, shaped as
vLLM's own server shapes them: choices (n per prompt, prompts in order), logprobs, echo, stop
reasons, token ids.

Chat and completions differ in object names, in how a choice holds its text and in the logprobs
format, so one `ResponseShape` subclass per endpoint carries those differences and the rest is
shared. The workers' chunks carry vLLM's logprobs as they are (`PositionLogprobs`); the text of
a token vLLM did not decode comes from the router's tokenizer (`decode`).
"""

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.protocol import worker_pb2

MIN_LOGPROB = -9999.0  # what OpenAI (and vLLM) report for -inf
# Logprob entries one response may carry (a position's top ones and its own token each count):
# ~40 bytes of JSON each, so ~80 MiB. What the router holds grows with it (security review H3).
MAX_RESPONSE_ENTRIES = 2_000_000


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


@dataclass(frozen=True)
class OutputOptions:
    """What the request asked to see, beyond the text."""

    logprobs: int | None = None  # top logprobs per token (None: no logprobs)
    all_top: bool = False  # logprob_token_ids: every entry the worker sent
    prompt_logprobs: bool = False  # the prompt's logprobs on the choice (completions)
    echo: bool = False
    echo_only: bool = False  # completions with max_tokens 0: the prompt alone
    as_token_ids: bool = False  # tokens as "token_id:N" (return_tokens_as_token_ids)
    return_token_ids: bool = False
    continuous_usage: bool = False  # usage so far on every streamed chunk


@dataclass
class Prompt:
    """One prompt of the request, as echo and its logprobs need it. `echo_text`: what echo
    puts first (the prompt's text; in chat, the last message when it is the assistant's)."""

    token_ids: list[int]
    echo_text: str = ""
    logprobs: list = field(default_factory=list)  # PositionLogprobs, from the worker


@dataclass
class Choice:
    """One choice of a whole response, put together from its chunks."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float = 0.0

    def add(self, chunk: worker_pb2.GenerateChunk, finish_reason: str | None) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        if finish_reason is not None:
            self.finish_reason, self.stop_reason = finish_reason, stop_reason(chunk)
            self.cumulative_logprob = chunk.cumulative_logprob


def stop_reason(chunk: worker_pb2.GenerateChunk) -> str | int | None:
    """vLLM's stop_reason: the stop string or token that ended the choice (None: end of
    sequence, or the length limit)."""
    which = chunk.WhichOneof("stop_reason")
    return getattr(chunk, which) if which else None


class ResponseShape:
    object_whole: str
    object_chunk: str

    def __init__(
        self,
        response_id: str,
        model: str,
        options: OutputOptions = OutputOptions(),
        decode: Callable[[int], str] = str,
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.options = options
        self.decode = decode  # token id -> its text, for tokens vLLM did not decode
        self.created = int(time.time())
        self._started: set[int] = set()  # choices whose first chunk went out
        self._text_offsets: dict[int, int] = {}
        self._tokens: dict[int, int] = {}  # tokens streamed per choice
        # What is rendered once per prompt: (kind, id(prompt)) -> (prompt, its logprobs, value)
        self._rendered: dict[tuple[str, int], tuple[Prompt, list, object]] = {}
        # A chunk that carries text alone (no logprobs, token ids or usage asked for; neither
        # a choice's first nor its last) is most of a stream: its event is this envelope
        # around the choice, the bytes json.dumps would write for it (a test compares them).
        self._text_only = (
            options.logprobs is None
            and not options.return_token_ids
            and not options.continuous_usage
        )
        self._event_start = (
            f'data: {{"id":{json.dumps(response_id)},"object":"{self.object_chunk}",'
            f'"created":{self.created},"model":{json.dumps(model)},"choices":['
        )

    # whole responses ----------------------------------------------------------------------

    def whole(self, prompts: list[Prompt], choices: list[list[Choice]], usage: Usage) -> dict:
        """`choices[p]`: prompt p's choices, in order."""
        body = []
        for prompt, prompt_choices in zip(prompts, choices, strict=True):
            body.extend(self.whole_choice(prompt, choice) for choice in prompt_choices)
        return self._envelope(self.object_whole, body, usage=usage.body())

    def whole_choice(self, prompt: Prompt, choice: Choice) -> dict:
        raise NotImplementedError

    # streaming ----------------------------------------------------------------------------

    def chunk_events(
        self, prompt: Prompt, index: int, chunk: worker_pb2.GenerateChunk, finish: str | None
    ) -> list[str]:
        """The SSE events for one worker chunk of choice `index` (in the response's numbering)."""
        first = index not in self._started
        self._started.add(index)
        self._tokens[index] = self._tokens.get(index, 0) + len(chunk.token_ids)
        if self._text_only and not first and finish is None:
            if not (chunk.text or chunk.token_ids):
                return []
            return [f"{self._event_start}{self.text_choice(index, chunk.text)}]}}\n\n"]
        extra = {}
        if self.options.continuous_usage:  # as vLLM: the prompt and this choice's tokens
            extra["usage"] = Usage(len(prompt.token_ids), self._tokens[index], 0).body()
        return [
            sse(self._envelope(self.object_chunk, [choice], **extra))
            for choice in self.stream_choices(prompt, index, chunk, finish, first)
        ]

    def stream_choices(
        self,
        prompt: Prompt,
        index: int,
        chunk: worker_pb2.GenerateChunk,
        finish: str | None,
        first: bool,
    ) -> list[dict]:
        raise NotImplementedError

    def text_choice(self, index: int, text: str) -> str:
        """A streamed choice of text alone, as JSON (what stream_choices gives for it)."""
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> str:
        return sse(self._envelope(self.object_chunk, [], usage=usage.body()))

    def _once(self, prompt: Prompt, kind: str, render: Callable[[Prompt], object]):
        """`render(prompt)`, made once per prompt (again if its logprobs were replaced) and
        shared by its choices: the JSON still repeats it, but the objects are made once."""
        key = (kind, id(prompt))
        kept = self._rendered.get(key)
        if kept is None or kept[1] is not prompt.logprobs:
            kept = self._rendered[key] = (prompt, prompt.logprobs, render(prompt))
        return kept[2]

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {
            "id": self.response_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def token_text(self, entry: worker_pb2.TokenLogprob) -> str:
        if self.options.as_token_ids:
            return f"token_id:{entry.token_id}"
        if entry.HasField("decoded_token"):
            return entry.decoded_token
        return self.decode(entry.token_id)

    def plain_token_text(self, token_id: int) -> str:
        if self.options.as_token_ids:
            return f"token_id:{token_id}"
        return self.decode(token_id)


class ChatShape(ResponseShape):
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def whole_choice(self, prompt: Prompt, choice: Choice) -> dict:
        text = choice.text
        if self.options.echo:
            text = prompt.echo_text + text
        body = {
            "index": choice.index,
            "message": {"role": "assistant", "content": text},
            "logprobs": self._logprobs(choice.token_ids, choice.logprobs),
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if self.options.return_token_ids:
            body["token_ids"] = choice.token_ids
        return body

    def stream_choices(self, prompt, index, chunk, finish, first) -> list[dict]:
        choices = []
        if first:  # as vLLM: the role alone first, then the echoed message
            choices.append(self._delta(index, {"role": "assistant", "content": ""}))
            if self.options.echo and prompt.echo_text:
                choices.append(self._delta(index, {"content": prompt.echo_text}))
        if chunk.text or chunk.token_ids or finish is not None:
            choice = self._delta(index, {"content": chunk.text})
            choice["logprobs"] = self._logprobs(list(chunk.token_ids), list(chunk.logprobs))
            if finish is not None:
                choice.update(finish_reason=finish, stop_reason=stop_reason(chunk))
            if self.options.return_token_ids:
                choice["token_ids"] = list(chunk.token_ids)
            choices.append(choice)
        return choices

    def text_choice(self, index: int, text: str) -> str:
        content = json.dumps(text)
        return (
            f'{{"index":{index},"delta":{{"content":{content}}},"logprobs":null,'
            '"finish_reason":null}'
        )

    @staticmethod
    def _delta(index: int, delta: dict) -> dict:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

    def _logprobs(self, token_ids: list[int], positions: list) -> dict | None:
        """vLLM's chat logprobs: per token its logprob and bytes, with the top ones."""
        top = self.options.logprobs
        if top is None:
            return None
        content = []
        for token_id, position in zip(token_ids, positions, strict=True):
            step = _entry(position, token_id)
            if step is None:
                token = self.plain_token_text(token_id)
                content.append(
                    {
                        "token": token,
                        "logprob": MIN_LOGPROB,
                        "bytes": list(token.encode("utf-8", errors="replace")),
                        "top_logprobs": [],
                    }
                )
                continue
            content.append(
                {
                    "token": self.token_text(step),
                    "logprob": max(step.logprob, MIN_LOGPROB),
                    "bytes": (
                        list(step.decoded_token.encode("utf-8", errors="replace"))
                        if step.HasField("decoded_token")
                        else None
                    ),
                    "top_logprobs": [
                        {
                            "token": (text := self.token_text(entry)),
                            "logprob": max(entry.logprob, MIN_LOGPROB),
                            "bytes": list(text.encode("utf-8", errors="replace")),
                        }
                        for rank, entry in enumerate(position.entries)
                        if self.options.all_top or top == -1 or rank < top
                    ],
                }
            )
        return {"content": content}


class CompletionShape(ResponseShape):
    object_whole = "text_completion"
    object_chunk = "text_completion"

    def whole_choice(self, prompt: Prompt, choice: Choice) -> dict:
        """The echoed prompt's logprobs and its prompt_logprobs are rendered once per prompt
        and shared by its choices (security review H3: once per choice, n=128 choices of an
        8k-token prompt made gigabytes)."""
        if self.options.echo_only:
            text, logprobs = prompt.echo_text, self._echoed(prompt)
        elif self.options.echo:
            text = prompt.echo_text + choice.text
            logprobs = self._after(self._echoed(prompt), choice.token_ids, choice.logprobs)
        else:
            text, logprobs = choice.text, self._logprobs(choice.token_ids, choice.logprobs, 0)
        body = {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if self.options.prompt_logprobs:
            body["prompt_logprobs"] = self._once(prompt, "prompt_logprobs", self._prompt_logprobs)
        if self.options.return_token_ids:
            body.update(prompt_token_ids=prompt.token_ids, token_ids=choice.token_ids)
        return body

    def text_choice(self, index: int, text: str) -> str:
        text = json.dumps(text)
        return (
            f'{{"index":{index},"text":{text},"logprobs":null,"finish_reason":null,'
            '"stop_reason":null}'
        )

    def stream_choices(self, prompt, index, chunk, finish, first) -> list[dict]:
        text, token_ids, positions = chunk.text, list(chunk.token_ids), list(chunk.logprobs)
        echoed = first and (self.options.echo or self.options.echo_only)
        if echoed and self.options.echo_only:
            text, token_ids, positions = prompt.echo_text, [], []
        elif echoed:
            text = prompt.echo_text + text
        if not (text or token_ids or (echoed and prompt.token_ids) or finish is not None):
            return []
        if echoed:
            logprobs = self._after(self._echoed(prompt), token_ids, positions)
        else:
            logprobs = self._logprobs(token_ids, positions, self._text_offsets.get(index, 0))
        if logprobs is not None and logprobs["tokens"]:
            # Advance by the tokens reported, not by the text: text held back for stop
            # strings lags the tokens (as vLLM counts it).
            self._text_offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": stop_reason(chunk) if finish is not None else None,
        }
        if self.options.return_token_ids:
            choice["token_ids"] = list(chunk.token_ids)
            if first:
                choice["prompt_token_ids"] = prompt.token_ids
        return [choice]

    def _echoed(self, prompt: Prompt) -> dict | None:
        """The logprobs of the echoed prompt, rendered once."""
        return self._once(prompt, "echoed", lambda p: self._logprobs(p.token_ids, p.logprobs, 0))

    def _prompt_logprobs(self, prompt: Prompt) -> list:
        return [self._prompt_position(position) for position in prompt.logprobs]

    def _after(self, head: dict | None, token_ids: list[int], positions: list) -> dict | None:
        """The logprobs of `head` (the echoed prompt's) followed by the tokens'; `head`'s
        entries are shared, not copied."""
        if head is None:
            return None
        offset = head["text_offset"][-1] + len(head["tokens"][-1]) if head["tokens"] else 0
        tail = self._logprobs(token_ids, positions, offset)
        return {key: head[key] + tail[key] for key in head}

    def _logprobs(self, token_ids: list[int], positions: list, first_offset: int) -> dict | None:
        """vLLM's completion logprobs: tokens, their logprobs, text offsets, and per position
        the top logprobs plus the position's own token."""
        top = self.options.logprobs
        if top is None:
            return None
        offsets, token_logprobs, tokens, tops = [], [], [], []
        for token_id, position in zip(token_ids, positions, strict=True):
            step = _entry(position, token_id)
            if step is None:  # the first prompt position has none
                token = self.plain_token_text(token_id)
                token_logprobs.append(None)
                tops.append(None)
            else:
                token = self.token_text(step)
                token_logprobs.append(max(step.logprob, MIN_LOGPROB))
                tops.append(
                    {
                        self.token_text(entry): max(entry.logprob, MIN_LOGPROB)
                        for rank, entry in enumerate(position.entries)
                        if self.options.all_top or top == -1 or top >= rank
                    }
                )
            offsets.append(offsets[-1] + len(tokens[-1]) if offsets else first_offset)
            tokens.append(token)
        return {
            "text_offset": offsets,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": tops,
        }

    @staticmethod
    def _prompt_position(position: worker_pb2.PositionLogprobs) -> dict | None:
        """vLLM's raw prompt logprobs: {token id: {logprob, rank, decoded_token}}, or None."""
        if not position.entries:
            return None
        return {
            str(entry.token_id): {
                "logprob": max(entry.logprob, MIN_LOGPROB),
                "rank": entry.rank,
                "decoded_token": (entry.decoded_token if entry.HasField("decoded_token") else None),
            }
            for entry in position.entries
        }


def logprob_entries(
    sampling: worker_pb2.SamplingParams,
    prompt_tokens: int,
    options: OutputOptions,
    prompt_per_choice: bool,
    vocab_size: int,
) -> int:
    """The most logprob entries the response carries for one prompt: each choice's output
    tokens', and, on an endpoint that puts the prompt's on every choice (completions: echo,
    prompt_logprobs), the prompt's once per choice; once in all elsewhere."""

    def per_position(field: str) -> int:
        if not sampling.HasField(field):
            return 0
        top = getattr(sampling, field)
        return (vocab_size if top < 0 or top > vocab_size else top) + 1

    choices = max(sampling.n, 1)
    output, prompt = per_position("logprobs"), per_position("prompt_logprobs")
    entries = choices * sampling.max_tokens * output
    if not prompt_per_choice:
        return entries + prompt_tokens * prompt
    if options.echo and options.logprobs is not None:
        entries += choices * prompt_tokens * output
    if options.prompt_logprobs:
        entries += choices * prompt_tokens * prompt
    return entries


def _entry(position: worker_pb2.PositionLogprobs, token_id: int):
    """The position's entry for `token_id`, or None."""
    for entry in position.entries:
        if entry.token_id == token_id:
            return entry
    return None


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")
