"""The metrics an SRE's dashboard needs, from a real daemon's /metrics: dcgm-exporter's UUID and
model labels on every per-device series, utilisation and memory of a CPU device as `krex status`
shows them, the commands a region holds now and the seconds each user's commands were held, the
daemon's own process_* series, no `_percent`; and packaging/grafana/krex.json, whose every query
names a series the daemon exports."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import pytest

from ..conftest import PY, ROOT, py_env, run_daemon, until
from .test_metrics import L, scrape
from .test_metrics_daemon import _free_port, _scrape_when_up

pytest.importorskip("prometheus_client", reason="prometheus-client not installed")

DASHBOARD = ROOT / "packaging" / "grafana" / "krex.json"

OWNER = """
import os, sys, time
from krex_async import region
with region("timing"):
    open(sys.argv[1], "w").close()
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.01)
"""


async def test_daemon_exports_device_labels_usage_holds_and_its_process(tmp_path: Path) -> None:
    addr = ("127.0.0.1", _free_port())
    inside, done = tmp_path / "inside", tmp_path / "done"
    owner = tmp_path / "owner.py"
    owner.write_text(OWNER)
    async with run_daemon("--metrics", f"{addr[0]}:{addr[1]}", "--policy", "region") as d:
        await _scrape_when_up(addr)
        async with await d.client() as c:
            sib = await c.submit(["sleep", "60"])
            for _ in range(600):  # the sibling runs before the region is asked for
                if any(x["state"] == "running" for x in (await c.status())["commands"]):
                    break
                await asyncio.sleep(0.05)
            h = await c.submit([PY, str(owner), str(inside), str(done)], env=py_env())
            await until(inside.exists, "the owner in its region")
            held = scrape(addr)
            done.touch()
            res = await h.wait()
            await sib.cancel(9)
            await sib.wait()
        # utilisation and memory are sampled every few seconds while --metrics serves
        await until(
            lambda: ("krex_device_utilization_ratio", L(device="cpu")) in scrape(addr), "a utilisation sample"
        )
        after = scrape(addr)
        full = scrape(addr, device_labels=True)
    assert res.returncode == 0, res.stderr
    assert held[("krex_commands_held", L(device="cpu", mode="frozen"))] == 1, held
    assert after[("krex_commands_held", L(device="cpu", mode="frozen"))] == 0
    assert after[("krex_held_seconds_total", L(user="root"))] > 0
    assert 0 <= after[("krex_device_utilization_ratio", L(device="cpu"))] <= 1
    total = after[("krex_device_memory_bytes", L(device="cpu", state="total"))]
    assert 0 < after[("krex_device_memory_bytes", L(device="cpu", state="used"))] < total
    assert after[("process_cpu_seconds_total", ())] > 0 and after[("process_open_fds", ())] > 0
    assert not [k for k in after if k[0].endswith("_percent")]
    info = next(dict(k[1]) for k in full if k[0] == "krex_device_info")
    per_device = [(n, dict(lb)) for n, lb in full if "device" in dict(lb) and n != "krex_device_info"]
    assert len({n for n, _ in per_device}) >= 10, per_device
    for name, lb in per_device:  # dcgm-exporter's labels, the same as device_info's, on each
        assert (lb["UUID"], lb["modelName"]) == (info["UUID"], info["modelName"]), (name, lb, info)
    assert info["modelName"], info


_NOT_METRICS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions, keywords,
    label names (in {...}, by/without/on/ignoring/group_*(...)), strings or durations."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][\w:]*", e):
        if e[m.end() :].lstrip().startswith("(") or m.group().lower() in _NOT_METRICS:
            continue
        names.add(m.group())
    return names


def dashboard_queries(dash: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets (rows' nested panels too) and the
    template variables' label_values(METRIC...) queries, as the metric selector they read."""
    out: list[str] = []
    panels = list(dash["panels"])
    while panels:
        p = panels.pop()
        panels += p.get("panels", [])
        out += [t["expr"] for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        q = v.get("query")
        text = q.get("query", "") if isinstance(q, dict) else ""
        if m := re.match(r"label_values\((.*),\s*\w+\)$", text):
            out.append(m.group(1))
    return out


def exported(addr: tuple[str, int]) -> set[str]:
    """The series names a daemon's /metrics declares (# TYPE) or samples."""
    with urllib.request.urlopen(f"http://{addr[0]}:{addr[1]}/metrics", timeout=5) as r:
        text = r.read().decode()
    names = set()
    for ln in text.splitlines():
        if ln.startswith("# TYPE "):
            _, _, name, kind = ln.split()[:4]
            names |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
        elif ln and not ln.startswith("#"):
            names.add(re.split(r"[{ ]", ln, maxsplit=1)[0])
    return names


def test_metric_names_are_read_from_promql() -> None:
    """The extractor the dashboard check relies on: functions, labels and keywords are not names."""
    expr = (
        'histogram_quantile(0.95, sum by (le, device) (rate(a_bucket{x=~"$i", y="b c"}[5m]))) '
        '/ ignoring(state) b_total{state="used"} and on(device) c'
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}


async def test_every_grafana_query_names_an_exported_series() -> None:
    dash = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dash)
    assert len(queries) >= 20, queries
    wanted = {n: q for q in queries for n in metric_names(q)}
    assert len(wanted) >= 20, wanted
    addr = ("127.0.0.1", _free_port())
    async with run_daemon("--metrics", f"{addr[0]}:{addr[1]}"):
        await _scrape_when_up(addr)
        names = exported(addr)
    missing = {n: q for n, q in wanted.items() if n not in names}
    assert not missing, f"dashboard queries naming no exported series: {missing}"
    assert "krex_no_such_series" not in names  # the check can fail: a made-up name is not there
