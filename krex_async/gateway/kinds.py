"""The job kinds: `dev` (a shell command with files) always; `eval` and `profile` where the
evaluator (Atrex-Bench's scripts/run_eval.py) and the profiler (ncu) are installed.

Each kind validates its request (raising limits.BadRequest), turns it into argv in a fresh job
directory, and reads its result back. `available()` says, for every kind that is not runnable
here, why not: the app answers those with a structured 501 `kind_not_supported`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from krex_async.gateway import limits as L
from krex_async.gateway.files import find, read_job_file, write_files
from krex_async.gateway.store import error

MAX_EVAL_RESULT = 64 * L.MiB


def find_evaluator(root: str | None) -> tuple[Path | None, str]:
    """scripts/run_eval.py under --atrex-bench-root, $ATREX_BENCH_ROOT or the installed
    atrex_bench package's checkout; (None, why) when there is none."""
    roots = [Path(r) for r in (root, os.environ.get("ATREX_BENCH_ROOT")) if r]
    try:
        spec = importlib.util.find_spec("atrex_bench")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        roots.append(Path(spec.origin).resolve().parent.parent.parent)
    for r in roots:
        runner = r.expanduser() / "scripts" / "run_eval.py"
        if runner.is_file():
            return runner.resolve(), ""
    where = ", ".join(map(str, roots)) or "no --atrex-bench-root, $ATREX_BENCH_ROOT or atrex_bench"
    return None, f"Atrex-Bench's scripts/run_eval.py was not found (searched {where})"


class Dev:
    """`bash -c COMMAND` (as the reference gateway; /bin/sh where there is no bash) in the job
    directory with the uploaded files."""

    def __init__(self, lim: L.Limits, accepted: frozenset[str]) -> None:
        self.lim, self.accepted = lim, accepted
        self.shell = shutil.which("bash") or "/bin/sh"

    def validate(self, payload: Any) -> tuple[dict[str, Any], str | None, str | None]:
        r = L.dev_request(payload, self.lim, self.accepted)
        req = {
            "spec": {"target_hardware": r.targets},
            "command": r.command,
            "files": r.files,
            "env_vars": r.env_vars,
            "timeout_s": r.timeout_s,
        }
        return req, r.idempotency_key, r.author

    def prepare(self, request: dict[str, Any], workdir: Path) -> tuple[list[str], float]:
        write_files(workdir, request.get("files") or {})
        return [self.shell, "-c", request["command"]], float(request["timeout_s"])

    def complete(
        self, request: dict[str, Any], workdir: Path, result: dict[str, Any], owner: int | None
    ) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
        if result["exit_code"] == 0:
            return "succeeded", result, None
        return "failed", result, error("command_failed", f"command exited with status {result['exit_code']}")


def _bundle(payload: Any, lim: L.Limits, accepted: frozenset[str]) -> dict[str, Any]:
    """The typed (eval, profile) request: a candidate and its reference, checked as the reference
    gateway checks them (422 for what it refuses)."""
    p = L.obj(payload)
    hw = L.targets(p, accepted)
    cand = p.get("candidate")
    if not isinstance(cand, str) or not cand.strip():
        raise L.Invalid("invalid_candidate", "candidate must be a non-empty Python source")
    ref = L.obj(p.get("reference"), "reference")
    op = ref.get("operator")
    if not isinstance(op, str) or not op.strip() or len(op) > 512:
        raise L.Invalid(
            "invalid_reference", "reference.operator must be a non-empty string of at most 512 characters"
        )
    for f in ("reference_py", "input_py"):
        if not isinstance(ref.get(f), str) or not ref[f].strip():
            raise L.Invalid("invalid_reference", f"reference.{f} must be a non-empty string")
    if not isinstance(ref.get("shapes"), dict) or not ref["shapes"]:
        raise L.Invalid("invalid_reference", "reference.shapes must be a non-empty object")
    for f in ("metadata", "roofline"):
        if f in ref and not isinstance(ref[f], dict):
            raise L.Invalid("invalid_reference", f"reference.{f} must be an object")
    opts = L.obj(p.get("options") or {}, "options")
    for name, lo, hi, default in (("num_correctness_cases", 1, 1000, 1), ("bench_iters", 1, 1_000_000, 100)):
        v = opts.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise L.Invalid("invalid_options", f"options.{name} must be an integer in {lo}..{hi}")
    for name in ("atol", "rtol"):
        v = opts.get(name, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
            raise L.Invalid("invalid_options", f"options.{name} must be a finite number >= 0")
    size = sum(len(s.encode()) for s in (cand, ref["reference_py"], ref["input_py"]))
    size += sum(len(json.dumps(ref.get(f) or {})) for f in ("shapes", "metadata", "roofline"))
    if size > lim.max_files_total:
        raise L.Invalid(
            "files_too_large",
            f"candidate and reference total {size} bytes; the limit is {lim.max_files_total}",
        )
    lock = p.get("lock_clocks", False)
    if not isinstance(lock, bool):
        raise L.Invalid("invalid_lock_clocks", "lock_clocks must be a boolean")
    return {
        "spec": {"target_hardware": hw},
        "candidate": cand,
        "reference": ref,
        "options": opts,
        "env_vars": L.env_vars(p.get("env_vars"), lim),
        "timeout_s": L.timeout(opts.get("timeout_s"), lim, "options.timeout_s"),
        "mode": p.get("mode", "full"),
        "lock_clocks": lock,
    }


def _materialize(request: dict[str, Any], workdir: Path) -> None:
    ref = request["reference"]
    files = {
        "candidate.py": request["candidate"],
        "reference/reference.py": ref["reference_py"],
        "reference/input.py": ref["input_py"],
        "reference/shapes.json": json.dumps(ref["shapes"]),
        "reference/metadata.json": json.dumps(ref.get("metadata") or {}),
    }
    if "roofline" in ref:
        files["reference/roofline.json"] = json.dumps(ref["roofline"])
    write_files(workdir, files)


class Eval:
    """Atrex-Bench's evaluator on the candidate; the result is its eval_result.json."""

    def __init__(
        self, lim: L.Limits, accepted: frozenset[str], runner: Path, python: str = sys.executable
    ) -> None:
        self.lim, self.accepted, self.runner, self.python = lim, accepted, runner, python

    def validate(self, payload: Any) -> tuple[dict[str, Any], str | None, str | None]:
        req = _bundle(payload, self.lim, self.accepted)
        if req["mode"] not in ("full", "correctness_only"):
            raise L.Invalid("invalid_mode", "mode must be 'full' or 'correctness_only'")
        p = L.obj(payload)
        return req, L.idempotency_key(p), p.get("author") if isinstance(p.get("author"), str) else None

    def argv(self, request: dict[str, Any], workdir: Path) -> list[str]:
        o = request["options"]
        iters = 1 if request["mode"] == "correctness_only" else o.get("bench_iters", 100)
        argv = [
            self.python,
            str(self.runner),
            "--input",
            str(workdir / "candidate.py"),
            "--reference-dir",
            str(workdir / "reference"),
            "--output",
            str(workdir / "eval_output"),
            "--atol",
            str(o.get("atol", 1e-2)),
            "--rtol",
            str(o.get("rtol", 0.05)),
            "--num-correctness-cases",
            str(o.get("num_correctness_cases", 1)),
            "--bench-iters",
            str(iters),
        ]
        return argv + (["--clock-locked"] if request["lock_clocks"] else [])

    def prepare(self, request: dict[str, Any], workdir: Path) -> tuple[list[str], float]:
        _materialize(request, workdir)
        return self.argv(request, workdir), float(request["timeout_s"])

    def complete(
        self, request: dict[str, Any], workdir: Path, result: dict[str, Any], owner: int | None
    ) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
        """As the reference gateway: an eval_result.json object is the job's result, whatever the
        evaluator's exit status (it exits 1 when the candidate fails correctness: that is an
        outcome of the evaluation, not a failed job)."""
        found = sorted(find(workdir, "eval_output", "eval_result.json"), key=lambda rel: rel.split("/"))
        if found:
            try:
                payload = json.loads(read_job_file(workdir, found[-1], owner, MAX_EVAL_RESULT))
            except (OSError, ValueError) as e:
                return "failed", result, error("invalid_eval_result", f"cannot read eval_result.json: {e}")
            if isinstance(payload, dict):
                payload["krex"] = {"regions": result["regions"], **result["krex"]}
                return "succeeded", payload, None
        return (
            "failed",
            result,
            error(
                "evaluator_failed",
                f"atrex-bench exited with status {result['exit_code']} without eval_result.json",
            ),
        )
