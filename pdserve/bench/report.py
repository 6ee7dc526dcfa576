"""Benchmark output: a terminal table, a JSON file (config, summary, every request) and PNG
plots (latency CDFs of one run; goodput against request rate over several runs)."""

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np

from pdserve.bench.metrics import Summary, TurnSummary, latency_samples
from pdserve.bench.records import RequestRecord
from pdserve.bench.sweep import SweepPoint, best_ratio, series

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.2f}"


def table(summary: Summary, records: list[RequestRecord]) -> str:
    lines = [
        f"{'Requests (completed / failed):':<36} {summary.num_requests} "
        f"({summary.completed} / {summary.failed})",
        f"{'Benchmark duration (s):':<36} {summary.duration_s:.2f}",
        f"{'Input / output tokens:':<36} "
        f"{summary.total_input_tokens} / {summary.total_output_tokens}",
        f"{'Request throughput (req/s):':<36} {summary.request_throughput:.2f}",
        f"{'Output token throughput (tok/s):':<36} {summary.output_throughput:.2f}",
        f"{'Total token throughput (tok/s):':<36} {summary.total_token_throughput:.2f}",
        *_hit_rate_lines(summary),
    ]
    if summary.slo is not None:
        limits = ", ".join(
            f"{k}<={v * 1000:g}ms" for k, v in asdict(summary.slo).items() if v is not None
        )
        attainment = "-" if summary.slo_attainment is None else f"{summary.slo_attainment:.1%}"
        lines.append(
            f"{'Goodput (req/s):':<36} {summary.goodput:.2f}  "
            f"({summary.good_requests} requests met {limits}: {attainment})"
        )
    lines.append(
        f"{'latency (ms)':<12}{'count':>8}{'mean':>10}{'p50':>10}{'p90':>10}{'p95':>10}{'p99':>10}"
    )
    for key, label in LATENCIES:
        d = getattr(summary, key)
        lines.append(
            f"{label:<12}{d.count:>8}{_ms(d.mean):>10}{_ms(d.p50):>10}"
            f"{_ms(d.p90):>10}{_ms(d.p95):>10}{_ms(d.p99):>10}"
        )
    if summary.turns:
        lines.extend(_turn_lines(summary.turns))
    errors = Counter(r.error for r in records if r.error is not None)
    for error, count in errors.most_common(5):
        lines.append(f"error x{count}: {error}")
    if len(errors) > 5:
        lines.append(f"... and {len(errors) - 5} other errors")
    return "\n".join(lines)


def _percent(rate: float | None, missing: str = "-") -> str:
    return missing if rate is None else f"{rate:.1%}"


def _hit_rate_lines(summary: Summary) -> list[str]:
    """The measured prefix hit rate, and, where the workload computes it, the infinite-cache
    bound and how much of it was reached (the KV pool's goal is at least 80%)."""
    measured, bound = summary.prefix_hit_rate, summary.infinite_cache_hit_rate
    lines = [f"{'Prefix cache hit rate:':<36} {_percent(measured, 'not reported by the server')}"]
    if bound is not None:
        reached = (
            f" (measured: {measured / bound:.0%} of it)" if measured is not None and bound else ""
        )
        lines.append(f"{'Infinite-cache hit rate (bound):':<36} {bound:.1%}{reached}")
    return lines


def _turn_lines(turns: list[TurnSummary]) -> list[str]:
    lines = [
        f"{'turn':<6}{'requests':>9}{'failed':>8}{'TTFT p50 (ms)':>15}{'TTFT p90 (ms)':>15}"
        f"{'hit rate':>10}{'infinite':>10}"
    ]
    for t in turns:
        lines.append(
            f"{t.turn:<6}{t.requests:>9}{t.failed:>8}{_ms(t.ttft.p50):>15}{_ms(t.ttft.p90):>15}"
            f"{_percent(t.prefix_hit_rate):>10}{_percent(t.infinite_cache_hit_rate):>10}"
        )
    return lines


def record_json(record: RequestRecord, start: float) -> dict:
    """The record but its reply text (the file keeps no prompt text either)."""
    fields = asdict(record)
    del fields["output_text"]
    return fields | {
        "send_time": record.send_time - start,  # seconds from the first send
        "input_tokens": record.input_tokens,
        "output_tokens": record.output_tokens,
        "tpot": record.tpot,
    }


def write_json(
    path: str | Path, config: dict, summary: Summary, records: list[RequestRecord]
) -> None:
    start = min((r.send_time for r in records), default=0.0)
    document = {
        "config": config,
        "summary": asdict(summary),
        "requests": [record_json(r, start) for r in records],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")


def _figure(width: float, height: float):
    # The Agg canvas directly, not pyplot: no global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def plot_cdfs(path: str | Path, records: list[RequestRecord], title: str = "") -> None:
    """One PNG with the empirical CDFs of TTFT, TPOT, ITL and E2E over successful requests."""
    samples = latency_samples(records)
    succeeded = sum(r.ok for r in records)
    figure = _figure(10, 7)
    figure.suptitle(title or f"latency CDFs ({succeeded} of {len(records)} requests succeeded)")
    for axes, (key, label) in zip(figure.subplots(2, 2).flat, LATENCIES, strict=True):
        values = np.sort(np.asarray(samples[key], dtype=float)) * 1000
        axes.set(title=label, xlabel="ms", ylabel="fraction of samples")
        if values.size:
            axes.step(values, np.arange(1, values.size + 1) / values.size, where="post")
        else:
            axes.text(0.5, 0.5, "no samples", ha="center", va="center", transform=axes.transAxes)
        axes.grid(alpha=0.3)
    _save(figure, path)


def plot_goodput_vs_rate(
    path: str | Path, points: list[tuple[float, float]], slo_label: str = ""
) -> None:
    """Goodput (req/s) against offered request rate (req/s), one point per benchmark run."""
    rates = [rate for rate, _ in points]
    _plot_against_rate(
        path,
        {"goodput": points},
        f"goodput vs request rate{f' ({slo_label})' if slo_label else ''}",
        "goodput (req/s)",
        diagonal_to=max(rates, default=0.0),
    )


def plot_sweep(path: str | Path, points: list[SweepPoint], slo_label: str = "") -> None:
    """Goodput per worker against request rate, one line per prefill:decode ratio; the best
    ratio's line is marked in the legend."""
    best = best_ratio(points)
    lines = {
        f"{ratio.label} (P:D){' best' if ratio == best else ''}": [
            (p.rate, p.goodput_per_worker) for p in group
        ]
        for ratio, group in series(points).items()
    }
    _plot_against_rate(
        path,
        lines,
        f"goodput per worker vs request rate{f' ({slo_label})' if slo_label else ''}",
        "goodput per worker (req/s)",
    )


def _plot_against_rate(
    path,
    lines: dict[str, list[tuple[float, float]]],
    title: str,
    ylabel: str,
    diagonal_to: float = 0.0,
) -> None:
    figure = _figure(6, 4.5)
    axes = figure.subplots()
    for label, points in lines.items():
        rates, values = zip(*sorted(points), strict=True) if points else ((), ())
        axes.plot(rates, values, marker="o", label=label)
    if diagonal_to:
        axes.plot(
            [0, diagonal_to], [0, diagonal_to], linestyle="--", color="gray", label="offered rate"
        )
    axes.set(title=title, xlabel="request rate (req/s)", ylabel=ylabel)
    axes.legend()
    axes.grid(alpha=0.3)
    _save(figure, path)
