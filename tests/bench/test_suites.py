"""Suite loaders on tiny problem folders of KernelBench's and Atrex-Bench's formats, written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gen_trace, suites
from bench.trace_format import validate_line
from tests.bench.conftest import run_script

# Plain-Python models, so the problems run on the cpu device without torch.
KB_PROBLEM = """
class Model:
    def __init__(self, scale):
        self.scale = scale

    def __call__(self, xs, ys):
        return [self.scale * x + y for x, y in zip(xs, ys)]


def get_inputs():
    return [[float(i) for i in range(3000)], [1.0] * 3000]


def get_init_inputs():
    return [2.0]
"""

ATREX_REF = """
class Model:
    def __init__(self, hidden_size, eps=1e-6):
        self.hidden_size, self.eps = hidden_size, eps

    def __call__(self, x):
        s = sum(v * v for v in x) ** 0.5 + self.eps
        return [v / s for v in x]
"""

ATREX_INPUT = """
def _make_inputs(num_tokens, hidden_size):
    return {"x": [float((i * 7) % 13) for i in range(num_tokens * hidden_size)]}
"""


def write_kernelbench(root: Path) -> Path:
    for level, name in ((1, "1_ScaleAdd.py"), (2, "7_ScaleAdd.py")):
        d = root / "KernelBench" / f"level{level}"
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(KB_PROBLEM)
    (root / "KernelBench" / "level1" / "2_not_a_problem.py").write_text("x = 1\n")
    return root


def write_atrex(root: Path) -> Path:
    op = root / "data" / "l2_norm_tiny"
    op.mkdir(parents=True)
    (op / "reference.py").write_text(ATREX_REF)
    (op / "input.py").write_text(ATREX_INPUT)
    (op / "shapes.json").write_text(
        json.dumps(
            {
                "0": {
                    "init_kwargs": {"hidden_size": 64},
                    "input_kwargs": {"num_tokens": 4, "hidden_size": 64},
                },
                "1": {
                    "init_kwargs": {"hidden_size": 64},
                    "input_kwargs": {"num_tokens": 32, "hidden_size": 64},
                },
            }
        )
    )
    (root / "data" / "incomplete").mkdir()
    (root / "data" / "incomplete" / "reference.py").write_text(ATREX_REF)
    return root


def test_kernelbench_listing(tmp_path: Path) -> None:
    probs = suites.kernelbench_problems(write_kernelbench(tmp_path))
    assert [p["problem"] for p in probs] == ["level1/1_ScaleAdd", "level2/7_ScaleAdd"]
    assert [p["problem"] for p in suites.kernelbench_problems(tmp_path, levels=[2])] == ["level2/7_ScaleAdd"]
    with pytest.raises(FileNotFoundError):
        suites.kernelbench_problems(tmp_path, levels=[3])


def test_atrex_listing(tmp_path: Path) -> None:
    probs = suites.atrex_problems(write_atrex(tmp_path))
    assert [p["problem"] for p in probs] == ["l2_norm_tiny#0", "l2_norm_tiny#1"]
    with pytest.raises(FileNotFoundError):
        suites.atrex_problems(tmp_path / "nowhere")


@pytest.mark.parametrize("suite", ["kernelbench", "atrex"])
def test_suite_commands_load_check_and_time(tmp_path: Path, suite: str) -> None:
    root = (write_kernelbench if suite == "kernelbench" else write_atrex)(tmp_path / "ck")
    out = tmp_path / "t.jsonl"
    run_script(
        "-m",
        "bench.gen_trace",
        "--profile",
        "quick",
        "--sessions",
        "4",
        "--seed",
        "2",
        "--suite",
        suite,
        "--suite-path",
        str(root),
        "-o",
        str(out),
    )
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(validate_line(c) == [] and c["kernel"]["kind"] == "suite" for c in lines)
    assert all(c["kernel"]["source"]["suite"] == suite for c in lines)
    p = run_script("-m", "bench.workload.agent_cmd", "--spec", json.dumps(lines[0]))
    res = json.loads(p.stdout.splitlines()[-1])
    assert res["check"]["ok"] and res["timing"]["median_ms"] > 0
    assert res["kernel"] == lines[0]["kernel"]["id"]


def test_suite_check_fails_for_a_nondeterministic_reference(tmp_path: Path) -> None:
    root = write_kernelbench(tmp_path)
    (root / "KernelBench" / "level1" / "1_ScaleAdd.py").write_text(
        KB_PROBLEM.replace("return [self.scale * x + y", "import random\n        return [random.random() + y")
    )
    (k,) = [k for k in suites.suite_kernels("kernelbench", root) if k["id"].endswith("1_ScaleAdd")]
    fn, check = suites.make_callable(k["source"], gpu=False, seed=0)
    ok, err = check()
    assert not ok and err > 0


def test_generator_needs_suite_path() -> None:
    p = run_script("-m", "bench.gen_trace", "--suite", "atrex", check=False)
    assert p.returncode == 2 and "--suite-path" in p.stderr
    with pytest.raises(ValueError):
        gen_trace.generate(gen_trace.load_profile("quick"), 2, 0, suite_kernels=[])
