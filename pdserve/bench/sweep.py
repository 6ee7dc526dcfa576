"""Results of a prefill:decode ratio sweep: one benchmark summary per (ratio, rate), ranked by
goodput per worker, the figure that decides how to spend GPUs (a worker is one GPU, or one
TP group; on CPU, one engine process)."""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.bench.metrics import Summary


@dataclass(frozen=True)
class Ratio:
    prefill: int
    decode: int

    @classmethod
    def parse_list(cls, text: str) -> list["Ratio"]:
        """ "1:1,2:1,1:2" → prefill:decode worker counts, at least one decode worker each."""
        ratios = []
        for item in text.replace(" ", "").split(","):
            prefill, _, decode = item.partition(":")
            if not (prefill.isdigit() and decode.isdigit()) or int(decode) < 1:
                raise ValueError(
                    f"bad ratio {item!r}: expected PREFILL:DECODE worker counts, e.g. 2:1"
                )
            ratios.append(cls(int(prefill), int(decode)))
        if len(set(ratios)) != len(ratios):
            raise ValueError(f"a ratio is given twice in {text!r}")
        return ratios

    @property
    def label(self) -> str:
        return f"{self.prefill}:{self.decode}"

    @property
    def workers(self) -> int:
        return self.prefill + self.decode


@dataclass(frozen=True)
class SweepPoint:
    ratio: Ratio
    rate: float
    summary: Summary  # with an SLO, so goodput is set

    @property
    def goodput_per_worker(self) -> float:
        return self.summary.goodput / self.ratio.workers


def best_ratio(points: list[SweepPoint]) -> Ratio:
    """The ratio with the highest goodput per worker at any rate; the first given wins a tie."""
    return max(points, key=lambda p: p.goodput_per_worker).ratio  # max keeps the first maximum


def series(points: list[SweepPoint]) -> dict[Ratio, list[SweepPoint]]:
    """Points grouped by ratio (in the order given), each group sorted by rate."""
    grouped: dict[Ratio, list[SweepPoint]] = {}
    for point in points:
        grouped.setdefault(point.ratio, []).append(point)
    return {ratio: sorted(group, key=lambda p: p.rate) for ratio, group in grouped.items()}


def sweep_table(points: list[SweepPoint]) -> str:
    best = best_ratio(points)
    lines = [
        f"  {'P:D':<6}{'workers':>8}{'rate':>8}{'goodput':>9}{'per worker':>11}{'SLO met':>9}"
        f"{'p90 TTFT ms':>13}{'p90 TPOT ms':>13}{'failed':>8}"
    ]
    for ratio, group in series(points).items():
        for point in group:
            s = point.summary
            lines.append(
                f"{'*' if ratio == best else ' '} "
                f"{ratio.label:<6}{ratio.workers:>8}{point.rate:>8.2f}"
                f"{s.goodput:>9.2f}{point.goodput_per_worker:>11.3f}{s.slo_attainment:>9.0%}"
                f"{_ms(s.ttft.p90):>13}{_ms(s.tpot.p90):>13}{s.failed:>8}"
            )
    peak = max(p.goodput_per_worker for p in points if p.ratio == best)
    lines.append(f"best ratio: {best.label} (P:D), {peak:.3f} req/s per worker at its best rate")
    return "\n".join(lines)


def write_sweep_json(path: str | Path, config: dict, points: list[SweepPoint]) -> None:
    document = {
        "config": config,
        "best_ratio": best_ratio(points).label,
        "points": [
            {
                "ratio": p.ratio.label,
                "prefill": p.ratio.prefill,
                "decode": p.ratio.decode,
                "rate": p.rate,
                "goodput_per_worker": p.goodput_per_worker,
                "summary": asdict(p.summary),
            }
            for p in points
        ],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"
