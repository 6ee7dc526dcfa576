"""The streamed chunks of text alone (most of a stream) are written from a template
(router/http/responses.py's text_choice): byte for byte what the general path's json.dumps writes,
for any text; every other chunk (a choice's first or last, or one with logprobs, token ids or
usage asked for) takes the general path."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.protocol import worker_pb2
from router.http.responses import ChatShape, CompletionShape, OutputOptions, Prompt, sse

SHAPES = (ChatShape, CompletionShape)
PROMPT = Prompt(token_ids=[1, 2, 3], echo_text="hi")


def general(shape, index: int, chunk, finish=None, first=False) -> list[str]:
    choices = shape.stream_choices(PROMPT, index, chunk, finish, first)
    return [sse(shape._envelope(shape.object_chunk, [choice])) for choice in choices]


@settings(max_examples=25, deadline=None)
@given(text=st.text(), index=st.integers(0, 99), model=st.text(min_size=1))
def test_a_text_chunk_is_written_as_json_dumps_writes_it(text, index, model):
    chunk = worker_pb2.GenerateChunk(text=text, token_ids=[7], index=index)
    for kind in SHAPES:
        shape = kind('cmpl-"x"', model)
        shape.chunk_events(PROMPT, index, chunk, None)  # the choice's first chunk
        (event,) = shape.chunk_events(PROMPT, index, chunk, None)
        assert event == general(shape, index, chunk)[0]
        json.loads(event.removeprefix("data: "))


def test_only_a_text_chunk_takes_the_template():
    position = worker_pb2.PositionLogprobs(
        entries=[worker_pb2.TokenLogprob(token_id=7, logprob=-0.5, rank=1, decoded_token="a")]
    )
    chunk = worker_pb2.GenerateChunk(text="a", token_ids=[7], logprobs=[position])
    for kind in SHAPES:
        plain = kind("id", "m")
        first = plain.chunk_events(PROMPT, 0, chunk, None)
        assert first == general(kind("id", "m"), 0, chunk, first=True)  # the role (chat) first
        last = plain.chunk_events(PROMPT, 0, chunk, "stop")
        assert '"finish_reason":"stop"' in last[-1]
        assert plain.chunk_events(PROMPT, 0, worker_pb2.GenerateChunk(), None) == []
        for options, shown in (
            (OutputOptions(return_token_ids=True), '"token_ids":[7]'),
            (OutputOptions(continuous_usage=True), '"usage":'),
            (OutputOptions(logprobs=0), "-0.5"),
        ):
            shape = kind("id", "m", options)
            shape.chunk_events(PROMPT, 0, chunk, None)
            (event,) = shape.chunk_events(PROMPT, 0, chunk, None)
            assert shown in event, (kind, options)
