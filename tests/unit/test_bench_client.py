"""The bench client, runner, reports and command against FakeOpenAIServer
(tests/unit/fake_openai_server.py), a stand-in (not the pdserve router) that streams OpenAI SSE
chunks with known delays (TTFT_S, ITL_S) and fails on request."""

import argparse
import asyncio
import json

import pytest

from pdserve.bench import command
from pdserve.bench.client import Target, make_http_client, send
from pdserve.bench.metrics import Slo, summarize
from pdserve.bench.report import plot_cdfs, plot_goodput_vs_rate, table, write_json
from pdserve.bench.runner import run
from pdserve.bench.workload import BenchRequest
from tests.unit.fake_openai_server import ITL_S, TTFT_S, FakeOpenAIServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def fake_server():
    fake = FakeOpenAIServer().start()
    yield fake
    fake.stop()


def send_one(url: str, endpoint: str, prompt: str, max_tokens: int = 5, timeout: float = 10.0):
    async def go():
        async with make_http_client() as http:
            target = Target(url, "fake-model", endpoint)
            return await send(http, target, BenchRequest(3, max_tokens, prompt=prompt), timeout)

    return asyncio.run(go())


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("prompt", ["hello there", "eos"])
def test_timings_match_injected_delays(fake_server, endpoint, prompt):
    record = send_one(fake_server.url, endpoint, prompt, max_tokens=5)
    assert record.error is None
    assert TTFT_S <= record.ttft < TTFT_S + 1.0
    # The chat stream's leading empty role chunk is not a token; a later empty one (EOS) is.
    assert record.output_chunks == 5 and len(record.itl) == 4
    # From the server's usage (the workload said 3 prompt tokens), and the streamed text.
    assert record.output_tokens == 5 and record.input_tokens == len(prompt.split())
    assert record.output_text == fake_server.log[-1].reply
    assert 0.6 * ITL_S <= sum(record.itl) / 4 < ITL_S + 0.5
    assert record.e2e == pytest.approx(record.ttft + sum(record.itl))
    assert record.tpot == pytest.approx((record.e2e - record.ttft) / 4)


@pytest.mark.parametrize(
    "prompt, timeout, expected",
    [
        ("http-error", 10.0, "HTTP 503"),
        ("stream-error", 10.0, "fake engine died"),
        ("malformed", 10.0, "malformed SSE"),
        ("truncate", 10.0, "without [DONE]"),
        ("hang", 0.5, "timed out"),
    ],
)
def test_errors_are_recorded_not_raised(fake_server, prompt, timeout, expected):
    record = send_one(fake_server.url, "completions", prompt, timeout=timeout)
    assert record.error is not None and expected in record.error
    assert not record.ok and record.tpot is None


def test_connection_error_is_recorded():
    record = send_one("http://127.0.0.1:9", "completions", "hello")  # port 9 (discard): refused
    assert record.error and "Connect" in record.error


def test_open_loop_run_reports_and_files(fake_server, tmp_path):
    prompts = ["a", "b", "http-error", "c"]
    requests = [BenchRequest(1, 3, prompt=p) for p in prompts]
    target = Target(fake_server.url, "fake-model")
    records, duration = asyncio.run(
        run(requests, target, offsets=[0.0, 0.1, 0.2, 0.3], progress=False)
    )
    assert [r.ok for r in records] == [True, True, False, True]
    assert duration >= 0.3 + TTFT_S + 2 * ITL_S
    sends = [r.send_time - records[0].send_time for r in records]
    assert all(0.1 * i - 0.02 <= s < 0.1 * i + 0.5 for i, s in enumerate(sends))

    summary = summarize(records, duration, Slo(ttft=5.0))
    assert (summary.completed, summary.failed, summary.good_requests) == (3, 1, 3)
    assert summary.slo_attainment == pytest.approx(
        0.75
    )  # the failed request stays in the denominator
    text = table(summary, records)
    assert "Goodput" in text and "HTTP 503" in text

    write_json(tmp_path / "out" / "bench.json", {"url": fake_server.url}, summary, records)
    document = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert document["summary"]["completed"] == 3 and len(document["requests"]) == 4
    assert document["requests"][2]["error"].startswith("HTTP 503")
    plot_cdfs(tmp_path / "plots" / "cdf.png", records)
    plot_goodput_vs_rate(tmp_path / "plots" / "goodput.png", [(1.0, 0.9), (2.0, 1.5)], "ttft<=5s")
    for name in ("cdf.png", "goodput.png"):
        assert (tmp_path / "plots" / name).read_bytes().startswith(b"\x89PNG")


def test_closed_loop_keeps_concurrency(fake_server):
    fake_server.max_in_flight = 0
    requests = [BenchRequest(1, 2, prompt=f"p{i}") for i in range(6)]
    records, duration = asyncio.run(
        run(requests, Target(fake_server.url, "fake-model"), concurrency=2, progress=False)
    )
    assert len(records) == 6 and all(r.ok for r in records)
    assert fake_server.max_in_flight == 2
    assert duration >= 3 * (TTFT_S + ITL_S)  # three rounds of two


def test_deadline_stops_sending_and_cuts_in_flight(fake_server):
    requests = [
        BenchRequest(1, 2, prompt="hang"),
        BenchRequest(1, 2, prompt="x"),
        BenchRequest(1, 2, prompt="y"),
    ]
    records, duration = asyncio.run(
        run(
            requests,
            Target(fake_server.url, "fake-model"),
            offsets=[0.0, 0.0, 5.0],
            max_duration=0.6,
            progress=False,
        )
    )
    assert len(records) == 2  # the third was due after the deadline: never sent
    assert "timed out" in records[0].error and records[1].ok
    assert 0.5 <= duration < 3.0


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve")
    command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_bench_command_end_to_end(fake_server, tmp_path, capsys):
    args = bench_args(
        "--url",
        fake_server.url,
        "--endpoint",
        "chat",
        "--num-requests",
        "4",
        "--request-rate",
        "20",
        "--input-len",
        "8",
        "--output-len",
        "3",
        "--slo",
        "ttft=2s,tpot=500ms",
        "--no-progress",
        "--output-json",
        str(tmp_path / "bench.json"),
        "--plot-dir",
        str(tmp_path / "plots"),
    )
    assert args.run(args) == 0
    assert "Goodput (req/s)" in capsys.readouterr().out
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["config"]["model"] == "fake-model"  # asked from /v1/models
    assert document["summary"]["completed"] == 4 and document["summary"]["good_requests"] == 4
    assert (tmp_path / "plots" / "latency_cdf.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--slo", "ttft=fast"], "bad SLO item"),
        (["--input-len", "ten"], "bad length"),
        (["--request-rate", "0"], "--request-rate must be positive"),
        (["--workload", "trace"], "--trace FILE"),
        (["--workload", "trace", "--trace", "/nonexistent/trace.jsonl"], "No such file"),
    ],
)
def test_bench_command_bad_input_exits_2(argv, message, capsys):
    args = bench_args("--url", "http://127.0.0.1:9", "--no-progress", *argv)
    assert args.run(args) == 2
    error = capsys.readouterr().err
    assert error.startswith("pdserve bench: error:") and message in error and error.count("\n") == 1
