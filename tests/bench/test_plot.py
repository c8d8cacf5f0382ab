"""bench/plot.py: the inflation CDFs on a symmetric-log axis, matplotlib from the `bench` extra."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_extra_installs_matplotlib() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("matplotlib") for d in extras["bench"])


def test_inflation_axis_is_symlog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib", reason="pip install -e '.[bench]'")
    import matplotlib.axes

    from bench import plot

    scales: list[str] = []
    real = matplotlib.axes.Axes.set_xscale

    def record(self: matplotlib.axes.Axes, value: str, **kw: object) -> None:
        scales.append(value)
        real(self, value, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_xscale", record)
    from bench.harness.output import read_json

    newest = sorted((ROOT / "bench/results").glob("h200-replay-*.json.gz"))[-1]
    paths = plot.plot(read_json(newest), tmp_path, "x")
    assert [p.name for p in paths] == ["x-throughput.png", "x-inflation-cdf.png"]
    assert scales and set(scales) == {"symlog"}


def test_plot_usage_errors(tmp_path: Path) -> None:
    import subprocess

    p = subprocess.run(
        [sys.executable, "-m", "bench.plot", str(tmp_path / "no.json")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr and "no.json" in p.stderr
