"""PNG plots of a replay's results file: throughput by policy, and the CDF of timing inflation per
bucket (one panel per bucket, one line per policy).

    python -m bench.plot bench/results/NAME.json [--outdir DIR]

The inflation axis is symmetric-log (linear within +-1%, logarithmic beyond): the unprotected
`shared` policy runs to +200-350% while `region` and `command` stay within a few percent, and on a
linear axis those two collapse into a line at 0.

Needs matplotlib (`pip install -e '.[bench]'`; not on the GPU machine: plot here from the fetched
JSON). Exits 2 with a message when matplotlib is missing; figures are closed after saving.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench.harness.output import module_prog, pyplot, read_json, results_stem
from bench.trace_format import BUCKETS, OTHER_BUCKET

COLORS = {"region": "tab:green", "command": "tab:blue", "shared": "tab:red"}
LINTHRESH_PCT = 1.0  # the inflation axis is linear within +-1%, logarithmic beyond


def _pct_label(x: float, _pos: object = None) -> str:
    return f"{x:+g}%" if x else "0"


def plot(data: dict[str, Any], outdir: Path, stem: str) -> list[Path]:
    """Write the PNGs; returns their paths. Raises ImportError without matplotlib."""
    plt = pyplot()
    if plt is None:
        raise ImportError("matplotlib is not importable")
    import matplotlib.ticker

    s = data["summary"]
    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    pols = list(s["policies"])
    fig, ax = plt.subplots(figsize=(5, 3.5))
    vals = [s["policies"][p]["commands_per_hour"] for p in pols]
    ax.bar(pols, vals, color=[COLORS.get(p, "gray") for p in pols])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    ideal = s["ideal_trace"]["ratio"]
    top = max(vals, default=1.0)
    if "command" in s["policies"]:
        line = s["policies"]["command"]["commands_per_hour"] * ideal
        top = max(top, line)
        ax.axhline(line, ls="--", color="gray", label=f"ideal region ({ideal:.2f}x command)")
        ax.legend(loc="upper left", fontsize=8)
    ax.set_ylim(0, top * 1.3)
    ax.set_ylabel("commands / hour")
    ax.set_title(f"throughput, {data['config']['commands']} commands, {data['config']['concurrency']} agents")
    fig.tight_layout()
    paths.append(outdir / f"{stem}-throughput.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    buckets = [
        b
        for b in (*BUCKETS, OTHER_BUCKET)
        if any(b in s["policies"][p]["inflation"]["by_bucket"] for p in pols)
    ]
    if buckets:
        fig, axes = plt.subplots(1, len(buckets), figsize=(4 * len(buckets), 3.5), squeeze=False)
        for ax, b in zip(axes[0], buckets):
            for p in pols:
                v = s["policies"][p]["inflation"]["by_bucket"].get(b)
                if not v:
                    continue
                xs = sorted(100.0 * x for x in v["values"])
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=f"{p} (n={len(xs)})", color=COLORS.get(p, "gray"))
            ax.axvline(0, color="black", lw=0.5)
            ax.set_xscale("symlog", linthresh=LINTHRESH_PCT)
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(_pct_label))
            ax.grid(True, which="major", axis="x", lw=0.3, alpha=0.5)
            ax.set_title(f"kernels {b}")
            ax.set_xlabel("median inflation vs isolated (%, symlog)")
            ax.set_ylabel("fraction of commands")
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(outdir / f"{stem}-inflation-cdf.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=module_prog(__spec__), description="plot a replay results file")
    ap.add_argument("results", type=Path)
    ap.add_argument("--outdir", type=Path, default=None)
    a = ap.parse_args(argv)
    try:
        data = read_json(a.results)
    except (OSError, ValueError) as e:
        ap.error(f"{a.results}: {e}")
    try:
        paths = plot(data, a.outdir or a.results.parent, results_stem(a.results))
    except ImportError:
        print("plot.py needs matplotlib (pip install matplotlib); the JSON has every number", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
