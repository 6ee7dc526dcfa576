"""`pdserve sweep`: ratio parsing, the best-ratio choice, table, JSON and plot on fake
benchmark results, and the command's flow against a fake OpenAI server standing in for the
clusters (no engine is started here)."""

import argparse
import json
from contextlib import contextmanager

import pytest

from pdserve.bench import sweep_command
from pdserve.bench.local_cluster import ClusterStartError, local_cluster
from pdserve.bench.metrics import Slo, summarize
from pdserve.bench.records import RequestRecord
from pdserve.bench.report import plot_sweep
from pdserve.bench.sweep import Ratio, SweepPoint, best_ratio, sweep_table, write_sweep_json
from pdserve.worker.processes import free_port
from tests.unit.fake_openai_server import FakeOpenAIServer

SLO = Slo(ttft=1.0)


def fake_point(ratio: str, rate: float, good: int, bad: int, duration: float = 10.0) -> SweepPoint:
    """A fake benchmark result: `good` requests within the SLO, `bad` ones past it."""
    records = [RequestRecord(10, 4, ttft=0.5, e2e=1.0, output_chunks=4) for _ in range(good)]
    records += [RequestRecord(10, 4, ttft=3.0, e2e=4.0, output_chunks=4) for _ in range(bad)]
    prefill, decode = map(int, ratio.split(":"))
    return SweepPoint(Ratio(prefill, decode), rate, summarize(records, duration, SLO))


# Goodput per worker (req/s): 1:1 peaks at 10/10/2 = 0.5; 2:1 at 12/10/3 = 0.4;
# 1:2 at 18/10/3 = 0.6.
FAKE_POINTS = [
    fake_point("1:1", 1.0, 10, 0),
    fake_point("1:1", 2.0, 8, 12),
    fake_point("2:1", 1.0, 10, 0),
    fake_point("2:1", 2.0, 12, 8),
    fake_point("1:2", 2.0, 18, 2),
    fake_point("1:2", 1.0, 10, 0),
]


def test_ratio_parsing():
    assert Ratio.parse_list("1:1, 2:1,1:2") == [Ratio(1, 1), Ratio(2, 1), Ratio(1, 2)]
    assert Ratio.parse_list("0:2") == [Ratio(0, 2)]  # decode workers only (local path)
    for bad in ("1", "1:0", "a:b", "1:1,1:1"):
        with pytest.raises(ValueError):
            Ratio.parse_list(bad)


def test_best_ratio_is_the_highest_goodput_per_worker_at_any_rate():
    assert FAKE_POINTS[4].goodput_per_worker == pytest.approx(0.6)
    assert best_ratio(FAKE_POINTS) == Ratio(1, 2)
    assert best_ratio(FAKE_POINTS[:4]) == Ratio(1, 1)  # 0.5 beats 2:1's 0.4 per worker


def test_table_marks_the_best_ratio_and_sorts_rates(tmp_path):
    lines = sweep_table(FAKE_POINTS).splitlines()
    rows = [line for line in lines[1:] if not line.startswith("best")]
    assert len(rows) == 6
    assert [row.startswith("*") for row in rows] == [False, False, False, False, True, True]
    assert rows[4].split()[1:3] == ["1:2", "3"] and rows[4].split()[3] == "1.00"  # 1:2 rows by rate
    assert lines[-1] == "best ratio: 1:2 (P:D), 0.600 req/s per worker at its best rate"


def test_json_and_plot(tmp_path):
    write_sweep_json(tmp_path / "sweep.json", {"rates": "1,2"}, FAKE_POINTS)
    document = json.loads((tmp_path / "sweep.json").read_text())
    assert document["best_ratio"] == "1:2" and len(document["points"]) == 6
    assert document["points"][1]["summary"]["goodput"] == pytest.approx(0.8)
    plot_sweep(tmp_path / "plot.png", FAKE_POINTS, "ttft<=1s")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_command_runs_every_ratio_and_rate(monkeypatch, tmp_path, capsys):
    fake = FakeOpenAIServer(ttft_s=0.02, itl_s=0.01).start()
    started = []

    @contextmanager
    def fake_cluster(prefill, decode, port, log_dir, serve_args, ready_timeout_s):
        started.append((prefill, decode, serve_args))
        yield fake.url

    monkeypatch.setattr(sweep_command, "local_cluster", fake_cluster)
    parser = argparse.ArgumentParser(prog="pdserve")
    sweep_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        [
            "sweep",
            "--ratios",
            "1:1,2:1",
            "--rates",
            "20,40",
            "--num-requests",
            "3",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--slo",
            "ttft=1s",
            "--serve-args",
            "--model tiny",
            "--output-dir",
            str(tmp_path),
            "--no-progress",
        ]
    )
    try:
        assert args.run(args) == 0
    finally:
        fake.stop()
    assert started == [(1, 1, ["--model", "tiny"]), (2, 1, ["--model", "tiny"])]
    document = json.loads((tmp_path / "sweep.json").read_text())
    assert [(p["ratio"], p["rate"]) for p in document["points"]] == [
        ("1:1", 20),
        ("1:1", 40),
        ("2:1", 20),
        ("2:1", 40),
    ]
    assert all(p["summary"]["completed"] == 3 for p in document["points"])
    assert document["best_ratio"] == "1:1"  # same fake latencies, fewer workers
    assert (tmp_path / "goodput_per_worker.png").exists()
    assert "best ratio: 1:1" in capsys.readouterr().out


def test_sweep_needs_an_slo_and_good_rates(capsys):
    parser = argparse.ArgumentParser(prog="pdserve")
    sweep_command.add_parser(parser.add_subparsers())
    for argv, message in (
        (["--rates", "1"], "--slo is required"),
        (["--rates", "1,x", "--slo", "ttft=1s"], "bad rate"),
        (["--rates", "1", "--slo", "ttft=1s", "--ratios", "1:0"], "bad ratio"),
    ):
        args = parser.parse_args(["sweep", *argv])
        assert args.run(args) == 2
        assert message in capsys.readouterr().err


def test_a_cluster_that_cannot_start_is_reported_and_stopped(tmp_path):
    with pytest.raises(ClusterStartError, match="exited with"):
        with local_cluster(
            1, 1, free_port(), tmp_path, ["--model", str(tmp_path / "no-such-model")], 120
        ):
            pytest.fail("a cluster without a model must not start")
