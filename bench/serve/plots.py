"""PNG charts of benchmark runs (matplotlib, the `bench` extra; imported only for --plot).

- latency_cdf.png: CDFs of TTFT, TPOT, ITL and E2EL, one line per request rate.
- throughput_vs_rate.png (sweeps only): output-token throughput, and request
  throughput and goodput, against the offered request rate.
Runs are the dicts main.py writes under "runs" in the JSON, so a saved JSON can be
re-plotted: `write_plots(json.load(f)["runs"], "plots/")`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.serve.metrics import LATENCY_METRICS


def rate_label(rate: float | str) -> str:
    return "inf" if rate in ("inf", float("inf")) else f"{float(rate):g}"


def samples_ms(run: dict, name: str) -> np.ndarray:
    """One latency metric's samples in ms from a run's per-request arrays."""
    if name == "itl":
        values = [gap for gaps in run["itls"] for gap in gaps]
    else:
        values = [v for v in run[f"{name}s"] if v is not None]
    return np.sort(np.asarray(values, dtype=float) * 1000.0)


def write_plots(runs: list[dict], directory: str | Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (name, heading) in zip(axes.flat, LATENCY_METRICS.items()):
        for run in runs:
            values = samples_ms(run, name)
            if values.size:
                fractions = np.arange(1, values.size + 1) / values.size
                ax.step(values, fractions, where="post", label=f"{rate_label(run['request_rate'])} req/s")
        ax.set_title(heading)
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    fig.suptitle("Latency CDFs")
    fig.tight_layout()
    written.append(directory / "latency_cdf.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    if len(runs) > 1:
        # Rates sit at even positions (inf included), labelled with their values.
        positions = np.arange(len(runs))
        labels = [rate_label(run["request_rate"]) for run in runs]
        fig, (tokens_ax, requests_ax) = plt.subplots(1, 2, figsize=(11, 4))
        tokens_ax.plot(positions, [run["output_throughput"] for run in runs], "o-", label="output tokens/s")
        tokens_ax.plot(positions, [run["total_token_throughput"] for run in runs], "s--",
                       label="total tokens/s")
        tokens_ax.set_ylabel("tokens/s")
        requests_ax.plot(positions, [run["request_throughput"] for run in runs], "o-", label="throughput")
        if all(run.get("request_goodput") is not None for run in runs):
            requests_ax.plot(positions, [run["request_goodput"] for run in runs], "s--", label="goodput")
        requests_ax.set_ylabel("requests/s")
        for ax, title in ((tokens_ax, "Token throughput"), (requests_ax, "Request throughput and goodput")):
            ax.set_xticks(positions, labels)
            ax.set_xlabel("offered request rate (req/s)")
            ax.set_title(title)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
        fig.tight_layout()
        written.append(directory / "throughput_vs_rate.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written
