"""What a `stagemesh bench` run measured: per-request latencies aggregated (mean, p50, p90, p99), throughput,
goodput against the SLOs given, errors by status; shown as a table, written as JSON and as a PNG plot.

TTFT is the time from sending a request to its first token; TPOT its time per output token after the first,
(e2e - TTFT) / (tokens - 1); ITL the gaps between its streamed messages; E2E the whole request. Throughput counts
completed requests over the measured run's wall time, from its first request sent to its last one done."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from stagemesh.bench_targets import Outcome

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")
"""The latency metrics, each reported in milliseconds."""


@dataclass(frozen=True)
class Slo:
    """A request is good when it meets every bound given (None: no bound), in milliseconds."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def given(self) -> dict[str, float]:
        return {k: v for k, v in vars(self).items() if v is not None}

    def met(self, o: Outcome) -> bool:
        measured = {"ttft_ms": o.ttft_s, "tpot_ms": o.tpot_s, "e2e_ms": o.e2e_s}
        for key, bound in self.given().items():
            if measured[key] is None and key == "tpot_ms":
                continue  # a one-token answer has no TPOT
            if o.error or measured[key] is None or measured[key] * 1e3 > bound:
                return False
        return not o.error


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile of values, interpolated linearly between the two nearest ranks (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean and percentiles, in ms; None each where there are no values."""
    ms = [v * 1e3 for v in values_s]
    return {"mean": sum(ms) / len(ms) if ms else None,
            **{f"p{p}": percentile(ms, p) if ms else None for p in PERCENTILES}}


def latencies(outcomes: Sequence[Outcome]) -> dict[str, list[float]]:
    """Each latency's values (seconds) over the completed requests."""
    done = [o for o in outcomes if not o.error]
    return {"ttft": [o.ttft_s for o in done if o.ttft_s is not None],
            "tpot": [o.tpot_s for o in done if o.tpot_s is not None],
            "itl": [gap for o in done for gap in o.itl_s],
            "e2e": [o.e2e_s for o in done]}


def aggregate(outcomes: Sequence[Outcome], duration_s: float, slo: Slo) -> dict:
    """The run's figures, as --json-out writes them (without the per-request list)."""
    done = [o for o in outcomes if not o.error]
    inputs = [o.input_len for o in done]
    output_tokens = sum(o.output_tokens for o in done)
    good = sum(slo.met(o) for o in outcomes) if slo.given() else None
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    return {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "errors": dict(collections.Counter(o.error for o in outcomes if o.error).most_common()),
        "total_input_tokens": sum(inputs) if inputs and None not in inputs else None,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) * per_s,
        "output_throughput": output_tokens * per_s,
        **{f"{name}_ms": summary(values) for name, values in latencies(outcomes).items()},
        "goodput": None if good is None else {
            "slo_ms": slo.given(), "good": good, "fraction": good / len(outcomes) if outcomes else 0.0,
            "rate": good * per_s},
    }


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(figures: dict) -> str:
    """The figures as a person reads them: the counts and rates, then one row per latency."""
    inputs = figures["total_input_tokens"]
    lines = [
        f"completed requests      {figures['completed']}   failed {figures['failed']}"
        + "".join(f"   {k} {v}" for k, v in figures["errors"].items()),
        f"duration                {figures['duration_s']:.2f} s",
        f"total input tokens      {'unknown (text prompts)' if inputs is None else inputs}",
        f"total output tokens     {figures['total_output_tokens']}",
        f"request throughput      {figures['request_throughput']:.3f} req/s",
        f"output token throughput {figures['output_throughput']:.2f} tok/s",
    ]
    if goodput := figures["goodput"]:
        bounds = ", ".join(f"{k.removesuffix('_ms')} <= {v:g} ms" for k, v in goodput["slo_ms"].items())
        lines.append(f"goodput                 {goodput['rate']:.3f} req/s, {goodput['fraction']:.1%} of requests "
                     f"({bounds})")
    header = f"{'latency (ms)':<14}" + "".join(f"{h:>10}" for h in ("mean", *(f"p{p}" for p in PERCENTILES)))
    lines += ["", header, "-" * len(header)]
    for name in LATENCIES:
        row = figures[f"{name}_ms"]
        lines.append(f"{name.upper():<14}" + "".join(f"{_number(row[k]):>10}" for k in row))
    return "\n".join(lines)


def check_plotting() -> None:
    """Raises ValueError, saying what to install, where matplotlib (an optional dependency) is missing."""
    try:
        import matplotlib  # noqa: F401  (optional: only --plot-out needs it)
    except ImportError:
        raise ValueError("--plot-out needs matplotlib, an optional dependency: pip install matplotlib") from None


def plot(outcomes: Sequence[Outcome], path: str, title: str) -> None:
    """Four panels: TTFT, TPOT and ITL histograms, and each request's E2E latency against when it was sent."""
    import matplotlib  # optional dependency: imported only when a plot is asked for (check_plotting)

    matplotlib.use("Agg")
    from matplotlib import pyplot

    values = latencies(outcomes)
    figure, axes = pyplot.subplots(2, 2, figsize=(11, 7))
    for ax, name in zip(axes.flat, ("ttft", "tpot", "itl"), strict=False):
        ax.hist([v * 1e3 for v in values[name]], bins=40, color="tab:blue")
        ax.set(title=name.upper(), xlabel="ms", ylabel="count")
    done = [o for o in outcomes if not o.error]
    ax = axes.flat[3]
    ax.scatter([o.sent_s for o in done], [o.e2e_s * 1e3 for o in done], s=8, label="completed")
    failed = [o for o in outcomes if o.error]
    if failed:
        ax.scatter([o.sent_s for o in failed], [o.e2e_s * 1e3 for o in failed], s=8, c="tab:red", label="failed")
    ax.set(title="E2E latency by send time", xlabel="sent at (s)", ylabel="ms")
    ax.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
