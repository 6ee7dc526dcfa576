"""pdserve/core/grpc_polling.py with the installed grpcio: with its setting, a grpc.aio call's
messages no longer wake gRPC's EventEngine threads (a grpcio that dropped the setting fails
here), and `pdserve`'s command line sets it before any command imports grpc."""

import os
import subprocess
import sys
import textwrap

import pytest

# One process serves an echo stream and calls it: 200 round trips 1 ms apart (each finding gRPC's
# threads asleep), printing how often the EventEngine threads were woken per round trip.
ROUND_TRIPS = textwrap.dedent(
    """
    import asyncio, pathlib, sys
    if sys.argv[1] == "pdserve":
        from pdserve.core.grpc_polling import poll_on_callers_thread
        poll_on_callers_thread()
    import grpc

    def event_engine_wakeups():
        woken = 0
        for thread in pathlib.Path("/proc/self/task").iterdir():
            if (thread / "comm").read_text().strip() == "event_engine":
                status = (thread / "status").read_text()
                woken += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        return woken

    async def echo(messages, context):
        async for message in messages:
            yield message

    async def main():
        handler = grpc.method_handlers_generic_handler(
            "t.T", {"E": grpc.stream_stream_rpc_method_handler(echo)}
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream("/t.T/E")()
            await call.write(b"x")
            await call.read()
            before = event_engine_wakeups()
            for _ in range(200):
                await call.write(b"x")
                assert await call.read() == b"x"
                await asyncio.sleep(0.001)
            print((event_engine_wakeups() - before) / 200)
            await call.done_writing()
        await server.stop(None)

    asyncio.run(main())
    """
)


def last_word(script: str, *args: str, setting: str | None = None) -> str:
    """The last word `script` prints, run in a new Python with GRPC_EXPERIMENTS `setting` (None:
    unset)."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if setting is not None:
        env["GRPC_EXPERIMENTS"] = setting
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout.split()[-1]


def wakeups_per_round_trip(mode: str) -> float:
    return float(last_word(ROUND_TRIPS, mode))


@pytest.mark.parametrize("mode", ["grpc's default", "pdserve"])
def test_pdserve_polling_leaves_the_event_engine_threads_asleep(mode):
    woken = wakeups_per_round_trip(mode)
    if mode == "pdserve":
        assert woken < 0.5, woken
    else:  # what the setting saves: several wake-ups each round trip
        assert woken > 2, woken


def test_the_command_line_sets_it_for_every_process_it_starts_unless_set():
    script = textwrap.dedent(
        """
        import os
        from pdserve import cli
        try:
            cli.main(["model", "--help"])
        except SystemExit:
            pass
        print(repr(os.environ.get("GRPC_EXPERIMENTS")))
        """
    )
    for given, expected in ((None, "'-event_engine_client,-event_engine_listener'"), ("", "''")):
        assert last_word(script, setting=given) == expected
