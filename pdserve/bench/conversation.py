"""The conversation workload: N multi-turn chats, each turn resending the whole history.

Turn k+1 of a conversation is its history (every earlier user message and the model's actual
reply to it, as streamed) plus a new user message, sent once turn k's reply has arrived and the
user has thought for a while (uniform in 0.5-1.5 times the mean think time, so conversations
started together drift apart instead of sending in lockstep). Conversations run side by side;
their starts follow the arrival options (open loop: conversations/s; closed loop: conversations
at a time). A failed turn ends its conversation: the next turn needs its reply.

Each turn's record carries its conversation, its turn number (0 for the first) and what an
infinite prefix cache would hold of its prompt: everything the previous turn computed, its
prompt and its reply but the reply's last token (sampled, never fed back, so it has no KV);
0 for turn 0. The bound counts the conversation's own history only: a chat template's default
system prompt, the same in every conversation, lets turn 0 hit a little too.
"""

import asyncio
from dataclasses import dataclass

from pdserve.bench.client import Target
from pdserve.bench.records import RequestRecord
from pdserve.bench.runner import Session, session
from pdserve.bench.workload import BenchRequest, Length, PromptText

THINK_SPREAD = 0.5  # think times are uniform in mean * (1 -+ THINK_SPREAD)


@dataclass
class Turn:
    """What the user does in one turn; the reply is the server's."""

    message: str  # the new user message
    message_tokens: int  # its token count (exact with a tokenizer)
    max_tokens: int
    think_s: float  # the pause between the previous reply and this message (0 for turn 0)


@dataclass
class Conversation:
    turns: list[Turn]


def conversations(
    n: int,
    turns: int,
    message_len: Length,
    output_len: Length,
    think_time: float,
    text: PromptText,
    first_message_len: Length | None = None,
) -> list[Conversation]:
    """`n` conversations of `turns` turns: new user messages of `message_len` tokens, replies of
    at most `output_len` tokens, `think_time` seconds (mean) between a reply and the next turn.
    `first_message_len`: the first message's tokens instead (a document or code the chat is
    about, every later turn resending it)."""
    if n < 1 or turns < 1:
        raise ValueError("--conversations and --turns must be at least 1")
    if think_time < 0:
        raise ValueError("--think-time must be 0 or more")
    result = []
    for _ in range(n):
        lengths = message_len.sample(text.rng, turns)
        if first_message_len is not None:
            lengths[0] = first_message_len.sample(text.rng, 1)[0]
        messages = [text.make(length) for length in lengths]
        thinks = think_time * text.rng.uniform(1 - THINK_SPREAD, 1 + THINK_SPREAD, size=turns)
        thinks[0] = 0.0
        outputs = output_len.sample(text.rng, turns)
        result.append(
            Conversation(
                [
                    Turn(message, text.count(message), output, float(think))
                    for message, output, think in zip(messages, outputs, thinks, strict=True)
                ]
            )
        )
    return result


async def run(
    talks: list[Conversation],
    target: Target,
    *,
    offsets: list[float] | None = None,
    concurrency: int | None = None,
    timeout: float = 600.0,
    max_duration: float | None = None,
    progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Hold the conversations, starting each at its offset (open loop) or `concurrency` at a time
    (closed loop); return (every turn's record, in send order; duration in seconds)."""
    records: list[RequestRecord] = []
    total = sum(len(talk.turns) for talk in talks)
    async with session(target, total, timeout, max_duration, progress) as running:

        async def hold(i: int) -> None:
            await _hold(running, i, talks[i], records)

        await running.run_jobs(len(talks), hold, offsets, concurrency)
    return sorted(records, key=lambda r: r.send_time), running.duration


async def _hold(
    running: Session, index: int, talk: Conversation, records: list[RequestRecord]
) -> None:
    history: list[dict] = []
    prompt_tokens = 0  # the workload's count, for a server that reports no usage
    previous: RequestRecord | None = None
    for number, turn in enumerate(talk.turns):
        if running.past_deadline(after=turn.think_s):
            return
        await asyncio.sleep(turn.think_s)
        history.append({"role": "user", "content": turn.message})
        prompt_tokens += turn.message_tokens
        request = BenchRequest(prompt_tokens, turn.max_tokens, messages=list(history))
        record = await running.send(request)
        record.conversation, record.turn = index, number
        record.cacheable_tokens = (
            0
            if previous is None
            else min(record.input_tokens, previous.input_tokens + previous.output_tokens - 1)
        )
        records.append(record)
        if not record.ok:
            return
        history.append({"role": "assistant", "content": record.output_text})
        prompt_tokens += record.output_tokens
        previous = record
