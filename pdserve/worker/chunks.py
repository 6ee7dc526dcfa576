"""vLLM's request outputs as the worker protocol's chunks: new tokens, text, logprobs, stop
reason and engine timing, for the router to shape into OpenAI responses."""

from pdserve.protocol import worker_pb2


def position_logprobs(positions) -> list[worker_pb2.PositionLogprobs]:
    """vLLM's logprobs (one {token id: Logprob} per position, or None) in vLLM's order."""
    converted = []
    for position in positions:
        entry = worker_pb2.PositionLogprobs()
        for token_id, logprob in (position or {}).items():
            added = entry.entries.add(
                token_id=token_id, logprob=logprob.logprob, rank=logprob.rank or 0
            )
            if logprob.decoded_token is not None:
                added.decoded_token = logprob.decoded_token
        converted.append(entry)
    return converted


def request_timing(metrics) -> worker_pb2.RequestTiming | None:
    """vLLM's per-request timestamps (engine-core monotonic clock) as durations."""
    if metrics is None or not metrics.first_token_ts:
        return None
    return worker_pb2.RequestTiming(
        queued_seconds=max(0.0, metrics.scheduled_ts - metrics.queued_ts),
        prefill_seconds=max(0.0, metrics.first_token_ts - metrics.scheduled_ts),
        decode_seconds=max(0.0, metrics.last_token_ts - metrics.first_token_ts),
    )


def to_chunk(output, choice: int) -> worker_pb2.GenerateChunk:
    """One output of a single-choice engine request (the worker runs each choice as one),
    labelled as choice `choice` of the client's request."""
    completion = output.outputs[0]
    chunk = worker_pb2.GenerateChunk(
        index=choice,
        token_ids=completion.token_ids,
        text=completion.text,
        finish_reason=completion.finish_reason or "",
        prompt_tokens=len(output.prompt_token_ids or ()),
        cached_tokens=output.num_cached_tokens or 0,
    )
    if completion.logprobs is not None:
        chunk.logprobs.extend(position_logprobs(completion.logprobs))
    if output.prompt_logprobs is not None:
        chunk.prompt_logprobs.extend(position_logprobs(output.prompt_logprobs))
    if isinstance(completion.stop_reason, str):
        chunk.stop_string = completion.stop_reason
    elif isinstance(completion.stop_reason, int):
        chunk.stop_token_id = completion.stop_reason
    if output.finished:
        if completion.cumulative_logprob is not None:
            chunk.cumulative_logprob = completion.cumulative_logprob
        if (timing := request_timing(output.metrics)) is not None:
            chunk.timing.CopyFrom(timing)
    return chunk
