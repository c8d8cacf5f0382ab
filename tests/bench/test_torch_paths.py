"""The GPU workload's torch code run on the host (KREX_BENCH_TORCH_DEVICE=cpu): kernels, references,
checks, host_sync timing and a torch KernelBench-style problem. Skips where torch is not installed
(the project's venv); the GPU itself is covered by bench/gpu/check_workload.py on the accelerator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gen_trace
from tests.bench.conftest import run_script

torch = pytest.importorskip("torch", reason="torch is not installed here")

SMALL = {
    "matmul": [128, 128, 128],
    "reduction": [64, 512],
    "softmax": [64, 512],
    "conv": [2, 8, 16, 16, 8, 3],
}

KB_TORCH = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.lin = nn.Linear(k, k)

    def forward(self, a):
        return torch.relu(self.lin(a))


def get_inputs():
    return [torch.randn(64, 128)]


def get_init_inputs():
    return [128]
"""


def _run(lines: list[dict], tmp_path: Path) -> list[dict]:
    f = tmp_path / "k.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    p = run_script(
        "-m",
        "bench.workload.agent_cmd",
        "--isolated",
        str(f),
        timeout=120,
        env={"KREX_BENCH_DEVICE": "", "KREX_BENCH_TORCH_DEVICE": "cpu"},
    )
    return [json.loads(x) for x in p.stdout.splitlines() if '"krex_bench"' in x]


def test_catalogue_kernels_check_and_time(tmp_path: Path) -> None:
    base = gen_trace.generate(gen_trace.load_profile("default"), 1, seed=0)[0]
    lines = []
    for k in gen_trace.CATALOGUE["gpu"]:
        if k["kind"] == "elementwise":
            continue  # its kernel is a fresh Triton compile: GPU only
        line = json.loads(json.dumps(base))
        line["kernel"] = dict(k, size=SMALL[k["kind"]])
        line["phases"]["timing"].update(method="host_sync", reps=4)
        line["phases"]["compile"]["gpu"]["count"] = 0
        lines.append(line)
    res = _run(lines, tmp_path)
    assert [r["kernel"] for r in res] == [x["kernel"]["id"] for x in lines]
    for r in res:
        assert r["backend"] == "torch" and r["check"]["ok"], r["check"]
        assert r["timing"]["n"] == 4 and r["timing"]["median_ms"] > 0


def test_kernelbench_torch_problem(tmp_path: Path) -> None:
    lvl = tmp_path / "kb" / "KernelBench" / "level1"
    lvl.mkdir(parents=True)
    (lvl / "3_LinearRelu.py").write_text(KB_TORCH)
    out = tmp_path / "t.jsonl"
    run_script(
        "-m",
        "bench.gen_trace",
        "--profile",
        "default",
        "--sessions",
        "1",
        "--suite",
        "kernelbench",
        "--suite-path",
        str(tmp_path / "kb"),
        "-o",
        str(out),
    )
    line = json.loads(out.read_text().splitlines()[0])
    line["phases"]["compile"]["gpu"]["count"] = 0
    line["phases"]["timing"]["method"] = "host_sync"
    (r,) = _run([line], tmp_path)
    assert r["check"]["ok"] and 3 <= r["reps"] == r["timing"]["n"]
