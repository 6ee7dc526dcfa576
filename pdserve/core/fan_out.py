"""n choices from one prompt, each its own engine request, merged into one stream.

The first choice runs alone until its first output. By then the prompt's KV (computed here, or
received from a prefill worker) is in the engine's prefix cache, and the other choices start
and find it there: the prompt is computed, or transferred, once, not n times. Only the first
choice carries the KV transfer, so exactly one engine request waits for it.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

_DONE = object()


async def fan_out(
    streams: list[Callable[[], AsyncIterator]],
) -> AsyncIterator[tuple[int, object]]:
    """Yield (choice, item) from every stream until all end; streams[0] starts first, the rest
    at its first item. An error in any stream ends all (their tasks are cancelled, which
    aborts their engine requests) and is raised here; so does closing this generator."""
    if len(streams) == 1:  # no task, no queue in the way of every token
        async with contextlib.aclosing(streams[0]()) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []

    async def pump(choice: int) -> None:
        try:
            async for item in streams[choice]():
                queue.put_nowait((choice, item))
            queue.put_nowait((choice, _DONE))
        except Exception as error:
            queue.put_nowait((choice, error))

    tasks.append(asyncio.create_task(pump(0)))
    running = len(streams)
    try:
        while running:
            choice, item = await queue.get()
            if len(tasks) < len(streams):  # the first choice's first item: start the rest
                tasks.extend(asyncio.create_task(pump(i)) for i in range(1, len(streams)))
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield choice, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
