"""Generate an agent-like replay trace from a profile (bench/profiles/NAME.json), reproducibly.

    python -m bench.gen_trace --profile default --sessions N --seed S -o trace.jsonl
    python -m bench.gen_trace --profile default --suite kernelbench --suite-path ~/KernelBench -o kb.jsonl

A profile's knobs are the published figures (see bench/README.md): `command_share`, the commands' share
of a session's wall-clock, sets each think time from the expected length of the command after it;
`timing_share`, the timing loop's share of a command, sets the repetitions; `bucket_mix` and
`method_mix` pick each session's kernel and timing method (an agent works on one kernel with one
harness). All randomness comes from one `random.Random(seed)`, floats are rounded and lines are written
with sorted keys, so the same profile, options and seed give a byte-identical file.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

from bench.harness.output import module_prog
from bench.trace_format import METHODS, VERSION, dump_lines, validate_line

PROFILES = Path(__file__).resolve().parent / "profiles"

# Kernels each target knows, with the bucket their size is expected to land in. GPU figures are
# estimates for an H200 (fp16 dense ~660 TFLOP/s, ~4.8 TB/s); CPU sizes are per backend ("numpy",
# or "python" where numpy is missing). The replay buckets by the isolated pass's measurement, so an
# estimate that is off moves a kernel between buckets in the report, it does not corrupt it.
CATALOGUE: dict[str, list[dict[str, Any]]] = {
    "gpu": [
        {
            "id": "mm16k-f16",
            "kind": "matmul",
            "size": [16384, 16384, 16384],
            "dtype": "float16",
            "bucket": ">10ms",
            "expected_ms": 13.5,
        },
        {
            "id": "mm8k-f32",
            "kind": "matmul",
            "size": [8192, 8192, 8192],
            "dtype": "float32",
            "bucket": ">10ms",
            "expected_ms": 20.0,
        },
        {
            "id": "mm8k-f16",
            "kind": "matmul",
            "size": [8192, 8192, 8192],
            "dtype": "float16",
            "bucket": "1-10ms",
            "expected_ms": 1.65,
        },
        {
            "id": "conv64x256x112",
            "kind": "conv",
            "size": [64, 256, 112, 112, 256, 3],
            "dtype": "float16",
            "bucket": "1-10ms",
            "expected_ms": 1.95,
        },
        {
            "id": "softmax32kx32k",
            "kind": "softmax",
            "size": [32768, 32768],
            "dtype": "float32",
            "bucket": "1-10ms",
            "expected_ms": 1.8,
        },
        {
            "id": "mm4k-f16",
            "kind": "matmul",
            "size": [4096, 4096, 4096],
            "dtype": "float16",
            "bucket": "0.1-1ms",
            "expected_ms": 0.21,
        },
        {
            "id": "ew128m",
            "kind": "elementwise",
            "size": [134217728],
            "dtype": "float32",
            "bucket": "0.1-1ms",
            "expected_ms": 0.22,
        },
        {
            "id": "sum16kx16k",
            "kind": "reduction",
            "size": [16384, 16384],
            "dtype": "float32",
            "bucket": "0.1-1ms",
            "expected_ms": 0.22,
        },
        {
            "id": "softmax8kx16k",
            "kind": "softmax",
            "size": [8192, 16384],
            "dtype": "float32",
            "bucket": "0.1-1ms",
            "expected_ms": 0.22,
        },
    ],
    "cpu": [
        {
            "id": "mm-large",
            "kind": "matmul",
            "size": {"numpy": [768, 768, 768], "python": [64, 64, 64]},
            "dtype": "float64",
            "bucket": ">10ms",
            "expected_ms": 20.0,
        },
        {
            "id": "conv-large",
            "kind": "conv",
            "size": {"numpy": [800000, 129], "python": [6000, 33]},
            "dtype": "float64",
            "bucket": ">10ms",
            "expected_ms": 15.0,
        },
        {
            "id": "mm-mid",
            "kind": "matmul",
            "size": {"numpy": [384, 384, 384], "python": [28, 28, 28]},
            "dtype": "float64",
            "bucket": "1-10ms",
            "expected_ms": 3.0,
        },
        {
            "id": "softmax-mid",
            "kind": "softmax",
            "size": {"numpy": [512, 1024], "python": [64, 256]},
            "dtype": "float64",
            "bucket": "1-10ms",
            "expected_ms": 3.0,
        },
        {
            "id": "ew-small",
            "kind": "elementwise",
            "size": {"numpy": [1000000], "python": [8000]},
            "dtype": "float64",
            "bucket": "0.1-1ms",
            "expected_ms": 0.3,
        },
        {
            "id": "sum-small",
            "kind": "reduction",
            "size": {"numpy": [1024, 1024], "python": [96, 600]},
            "dtype": "float64",
            "bucket": "0.1-1ms",
            "expected_ms": 0.3,
        },
    ],
}

IMPORTS = {"gpu": ["torch", "triton"], "cpu": ["numpy"]}


def load_profile(name_or_path: str) -> dict[str, Any]:
    """A profile by name (bench/profiles/NAME.json) or path, with its `base` chain merged under it.

    Raises FileNotFoundError for an unknown profile and ValueError for a base cycle.
    """
    seen: list[str] = []
    layers: list[dict[str, Any]] = []
    cur: str | None = name_or_path
    while cur is not None:
        if cur in seen:
            raise ValueError(f"profile base cycle: {' -> '.join(seen + [cur])}")
        seen.append(cur)
        p = Path(cur) if cur.endswith(".json") else PROFILES / f"{cur}.json"
        layer = json.loads(p.read_text(encoding="utf-8"))
        layers.append(layer)
        cur = layer.get("base")
    merged: dict[str, Any] = {}
    for layer in reversed(layers):
        merged.update({k: v for k, v in layer.items() if k != "base"})
    return merged


def _pick(rng: random.Random, mix: dict[str, float]) -> str:
    keys = sorted(mix)
    return rng.choices(keys, weights=[mix[k] for k in keys])[0]


def _poisson(rng: random.Random, lam: float) -> int:
    if lam <= 0:
        return 0
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def _jittered(rng: random.Random, mean: float, jitter: float) -> float:
    if mean <= 0:
        return 0.0
    return round(max(0.0, mean * (1.0 + jitter * rng.uniform(-1.0, 1.0))), 4)


def _kernels(profile: dict[str, Any], suite_kernels: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if suite_kernels is not None:
        return suite_kernels
    return profile.get("catalogue") or CATALOGUE[profile["target"]]


def _session_kernel(
    rng: random.Random, profile: dict[str, Any], kernels: list[dict[str, Any]]
) -> dict[str, Any]:
    if kernels and kernels[0]["kind"] == "suite":
        return rng.choice(kernels)
    bucket = _pick(rng, {b: w for b, w in profile["bucket_mix"].items() if w > 0})
    fits = [k for k in kernels if k["bucket"] == bucket] or kernels
    return rng.choice(fits)


def _command(
    rng: random.Random,
    profile: dict[str, Any],
    session: str,
    order: int,
    seed: int,
    kernel: dict[str, Any],
    method: str,
) -> dict[str, Any]:
    target = profile["target"]
    phases: dict[str, Any] = {}
    for name in ("import", "compile", "inputs", "check"):
        spec = profile["phases"][name]
        jit = float(spec.get("jitter", 0.0))
        phases[name] = {
            "expect_s": _jittered(rng, float(spec["expect_s"]), jit),
            "cpu_s": _jittered(rng, float(spec.get("cpu_s", 0.0)), jit),
        }
    phases["import"]["modules"] = IMPORTS[target]
    cspec = profile["phases"]["compile"]
    phases["compile"]["gpu"] = (
        {
            "compile": cspec.get("compile", "triton"),
            "count": int(cspec.get("count", 1)),
            "tag": f"{seed}-{session}-{order}",
        }
        if target == "gpu"
        else None
    )
    phases["compile"]["tag"] = f"{seed}-{session}-{order}"
    kern = {"kind": kernel["kind"], "size": kernel.get("size"), "dtype": kernel.get("dtype")}
    phases["inputs"]["gpu"] = dict(kern)
    phases["check"]["gpu"] = dict(kern, reps=1)
    t = profile["timing"]
    others = sum(phases[n]["expect_s"] for n in ("import", "compile", "inputs", "check"))
    share = float(profile["timing_share"])
    timing_s = share / (1.0 - share) * others
    ms = float(kernel.get("expected_ms") or 1.0)
    reps = int(min(t["max_reps"], max(t["min_reps"], round(timing_s * 1000.0 / ms))))
    warm = float(t.get("warmup_ms", 25))
    phases["timing"] = {
        "method": method,
        "reps": reps,
        "warmup_ms": warm,
        "cpu_s": 0.0,
        "expect_s": round((reps * ms + warm) / 1000.0, 4),
        "gpu": dict(kern, reps=reps, bucket=kernel.get("bucket")),
    }
    cmd_s = others + phases["timing"]["expect_s"]
    cs = float(profile["command_share"])
    think_mean = cmd_s * (1.0 - cs) / cs
    tk = profile.get("think", {})
    sigma = float(tk.get("sigma", 0.6))
    think = rng.lognormvariate(math.log(think_mean) - sigma * sigma / 2.0, sigma) if think_mean > 0 else 0.0
    think = min(think, float(tk.get("max_factor", math.inf)) * think_mean)
    if order == 0 and tk.get("first") == "residual":
        think *= rng.random()  # the replay window opens while the agent is already thinking
    return {
        "v": VERSION,
        "session": session,
        "order": order,
        "think_s": round(think, 4),
        "target": target,
        "kernel": kernel,
        "phases": phases,
    }


def generate(
    profile: dict[str, Any], sessions: int, seed: int, suite_kernels: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The trace's lines, sessions in order. Pure: the result depends only on the arguments."""
    rng = random.Random(seed)
    kernels = _kernels(profile, suite_kernels)
    if not kernels:
        raise ValueError("no kernels to generate commands for (empty catalogue or suite)")
    cps = profile["commands_per_session"]
    methods = {m: w for m, w in profile["method_mix"].items() if w > 0 and m in METHODS}
    out: list[dict[str, Any]] = []
    width = max(3, len(str(sessions - 1)))
    for s in range(sessions):
        name = f"s{s:0{width}d}"
        kernel = _session_kernel(rng, profile, kernels)
        method = _pick(rng, methods)
        n = min(int(cps["max"]), max(int(cps["min"]), 1 + _poisson(rng, float(cps["mean"]) - 1.0)))
        out.extend(_command(rng, profile, name, i, seed, kernel, method) for i in range(n))
    return out


def summary(lines: list[dict[str, Any]]) -> dict[str, float]:
    """Expected totals of a trace: command share of session time, timing share of command time."""
    cmd = sum(sum(p["expect_s"] for p in c["phases"].values()) for c in lines)
    think = sum(c["think_s"] for c in lines)
    timing = sum(c["phases"]["timing"]["expect_s"] for c in lines)
    return {
        "commands": len(lines),
        "command_s": round(cmd, 3),
        "think_s": round(think, 3),
        "command_share": round(cmd / (cmd + think), 4) if cmd + think else 0.0,
        "timing_share": round(timing / cmd, 4) if cmd else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=module_prog(__spec__), description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="default", help="name in bench/profiles or a .json path")
    ap.add_argument("--sessions", type=int, default=None, help="default: the profile's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--suite", choices=("kernelbench", "atrex"), default=None)
    ap.add_argument("--suite-path", default=None, help="checkout of the suite (never copied)")
    ap.add_argument("--suite-levels", default="1,2,3", help="KernelBench levels to use")
    ap.add_argument("-o", "--out", default="-")
    a = ap.parse_args(argv)
    profile = load_profile(a.profile)
    suite_kernels = None
    if a.suite:
        if not a.suite_path:
            ap.error("--suite needs --suite-path")
        from bench import suites

        levels = [int(x) for x in a.suite_levels.split(",") if x]
        suite_kernels = suites.suite_kernels(
            a.suite, a.suite_path, levels=levels, expected_ms=float(profile.get("suite_expected_ms", 1.0))
        )
    lines = generate(profile, a.sessions or int(profile["sessions"]), a.seed, suite_kernels)
    for line in lines:
        errs = validate_line(line)
        assert not errs, errs
    text = "".join(dump_lines(lines))
    if a.out == "-":
        sys.stdout.write(text)
    else:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text, encoding="utf-8")
    print(json.dumps(dict(summary(lines), profile=profile["name"], seed=a.seed)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
