"""The replay trace: one JSON object per line, one line per command. See bench/README.md.

This module is the single definition of the format: the field names, the duration buckets, the timing
methods, and `validate_line()` which returns a list of problems (empty when the line is valid) so that
callers can report every problem at once instead of the first one. It imports nothing outside the
standard library so that the generator, the replay and the command itself can all use it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from bench.harness.output import read_text

VERSION = 1
PHASES = ("import", "compile", "inputs", "check", "timing")
BUCKETS = (">10ms", "1-10ms", "0.1-1ms")
OTHER_BUCKET = "<0.1ms"
METHODS = ("cuda_events", "do_bench", "host_sync")
KINDS = ("matmul", "elementwise", "reduction", "softmax", "conv", "suite")
TARGETS = ("gpu", "cpu")


def bucket_of(ms: float) -> str:
    """The duration bucket of a kernel that takes `ms` milliseconds (its isolated median)."""
    if ms > 10.0:
        return ">10ms"
    if ms >= 1.0:
        return "1-10ms"
    if ms >= 0.1:
        return "0.1-1ms"
    return OTHER_BUCKET


def kernel_key(line: dict[str, Any]) -> str:
    """Identity of the timed kernel and method: what the isolated pass measures once."""
    return f"{line['kernel']['id']}|{line['phases']['timing']['method']}"


def _num(d: dict[str, Any], key: str, where: str, errs: list[str], lo: float = 0.0) -> None:
    v = d.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < lo:
        errs.append(f"{where}.{key}: expected a number >= {lo}, got {v!r}")


def validate_line(line: Any) -> list[str]:
    """Every problem with one parsed trace line, as 'field: what is wrong' strings."""
    errs: list[str] = []
    if not isinstance(line, dict):
        return [f"line: expected an object, got {type(line).__name__}"]
    if line.get("v") != VERSION:
        errs.append(f"v: expected {VERSION}, got {line.get('v')!r}")
    if not isinstance(line.get("session"), str) or not line.get("session"):
        errs.append("session: expected a non-empty string")
    if not isinstance(line.get("order"), int) or line["order"] < 0:
        errs.append("order: expected an integer >= 0")
    _num(line, "think_s", "line", errs)
    if line.get("target") not in TARGETS:
        errs.append(f"target: expected one of {TARGETS}, got {line.get('target')!r}")
    k = line.get("kernel")
    if not isinstance(k, dict):
        errs.append("kernel: expected an object")
    else:
        if not isinstance(k.get("id"), str) or not k.get("id"):
            errs.append("kernel.id: expected a non-empty string")
        if k.get("kind") not in KINDS:
            errs.append(f"kernel.kind: expected one of {KINDS}, got {k.get('kind')!r}")
        if k.get("bucket") not in (*BUCKETS, None):
            errs.append(f"kernel.bucket: expected one of {BUCKETS} or null, got {k.get('bucket')!r}")
        if k.get("kind") == "suite":
            src = k.get("source")
            if not isinstance(src, dict) or src.get("suite") not in ("kernelbench", "atrex"):
                errs.append("kernel.source: a suite kernel needs {suite: kernelbench|atrex, path}")
        elif not isinstance(k.get("size"), (dict, list)):
            errs.append("kernel.size: expected a list, or an object of lists by backend")
    ph = line.get("phases")
    if not isinstance(ph, dict):
        return errs + ["phases: expected an object"]
    missing = [p for p in PHASES if p not in ph]
    if missing:
        errs.append(f"phases: missing {missing}")
    for name in PHASES:
        p = ph.get(name)
        if not isinstance(p, dict):
            continue
        _num(p, "cpu_s", f"phases.{name}", errs)
        gpu = p.get("gpu")
        if gpu is not None and not isinstance(gpu, dict):
            errs.append(f"phases.{name}.gpu: expected an object or null")
        elif isinstance(gpu, dict) and "reps" in gpu:
            _num(gpu, "reps", f"phases.{name}.gpu", errs, 0)
    t = ph.get("timing")
    if isinstance(t, dict):
        if t.get("method") not in METHODS:
            errs.append(f"phases.timing.method: expected one of {METHODS}, got {t.get('method')!r}")
        _num(t, "reps", "phases.timing", errs, 1)
        _num(t, "warmup_ms", "phases.timing", errs)
    return errs


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """All lines of a trace file, validated. Raises ValueError naming the line and every problem."""
    out: list[dict[str, Any]] = []
    # a trace file gzipped or not
    for n, raw in enumerate(read_text(path).splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from None
        errs = validate_line(line)
        if errs:
            raise ValueError(f"{path}:{n}: " + "; ".join(errs))
        out.append(line)
    return out


def sessions(lines: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Commands grouped by session, each session's in `order`, sessions in first-seen order."""
    by: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        by.setdefault(line["session"], []).append(line)
    for cmds in by.values():
        cmds.sort(key=lambda c: c["order"])
    return by


def dump_lines(lines: Iterable[dict[str, Any]]) -> Iterator[str]:
    """Canonical text of each line: sorted keys, no spaces, so equal traces are equal bytes."""
    for line in lines:
        yield json.dumps(line, sort_keys=True, separators=(",", ":")) + "\n"
