"""The job kinds: `dev` (a shell command with files) always; `eval` and `profile` where the
evaluator (Atrex-Bench's scripts/run_eval.py) and the profiler (ncu) are installed.

Each kind validates its request (raising limits.BadRequest), turns it into argv in a fresh job
directory, and reads its result back. `available()` says, for every kind that is not runnable
here, why not: the app answers those with a structured 501 `kind_not_supported`.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from . import limits as L
from .jobs import write_files
from .store import error

PROFILE_LEVELS = ("survey", "sol", "deep")
NCU_METRICS = ("gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
               "dram__throughput.avg.pct_of_peak_sustained_elapsed")


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
    """`/bin/sh -c COMMAND` in the job directory with the uploaded files."""

    def __init__(self, lim: L.Limits, accepted: frozenset[str]) -> None:
        self.lim, self.accepted = lim, accepted

    def validate(self, payload: Any) -> tuple[dict[str, Any], str | None, str | None]:
        r = L.dev_request(payload, self.lim, self.accepted)
        req = {"spec": {"target_hardware": r.targets}, "command": r.command, "files": r.files,
               "env_vars": r.env_vars, "timeout_s": r.timeout_s}
        return req, r.idempotency_key, r.author

    def prepare(self, request: dict[str, Any], workdir: Path) -> tuple[list[str], float]:
        write_files(workdir, request.get("files") or {})
        return ["/bin/sh", "-c", request["command"]], float(request["timeout_s"])

    def complete(self, request: dict[str, Any], workdir: Path, result: dict[str, Any]
                 ) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
        if result["exit_code"] == 0:
            return "succeeded", result, None
        return "failed", result, error("command_failed",
                                       f"command exited with status {result['exit_code']}")


def _bundle(payload: Any, lim: L.Limits, accepted: frozenset[str]) -> dict[str, Any]:
    """The typed (eval, profile) request: a candidate and its reference, checked."""
    p = L.obj(payload)
    hw = L.targets(p, accepted)
    cand = p.get("candidate")
    if not isinstance(cand, str) or not cand.strip():
        raise L.BadRequest("invalid_candidate", "candidate must be a non-empty Python source")
    ref = L.obj(p.get("reference"), "reference")
    for f in ("operator", "reference_py", "input_py"):
        if not isinstance(ref.get(f), str) or not ref[f].strip():
            raise L.BadRequest("invalid_reference", f"reference.{f} must be a non-empty string")
    if not isinstance(ref.get("shapes"), dict) or not ref["shapes"]:
        raise L.BadRequest("invalid_reference", "reference.shapes must be a non-empty object")
    opts = L.obj(p.get("options") or {}, "options")
    for name, lo, hi, default in (("num_correctness_cases", 1, 1000, 1),
                                  ("bench_iters", 1, 1_000_000, 100)):
        v = opts.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise L.BadRequest("invalid_options", f"options.{name} must be an integer in {lo}..{hi}")
    for name in ("atol", "rtol"):
        v = opts.get(name, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise L.BadRequest("invalid_options", f"options.{name} must be a finite number >= 0")
    size = sum(len(s.encode()) for s in (cand, ref["reference_py"], ref["input_py"]))
    if size > lim.max_files_total:
        raise L.BadRequest("files_too_large", f"sources total {size} bytes", 413)
    return {"spec": {"target_hardware": hw}, "candidate": cand, "reference": ref,
            "options": opts, "env_vars": L.env_vars(p.get("env_vars"), lim),
            "timeout_s": L.timeout(opts.get("timeout_s"), lim, "options.timeout_s"),
            "mode": p.get("mode", "full"), "lock_clocks": bool(p.get("lock_clocks", False)),
            "level": p.get("level", "sol"), "kernel_regex": p.get("kernel_regex")}


def _materialize(request: dict[str, Any], workdir: Path) -> None:
    ref = request["reference"]
    files = {"candidate.py": request["candidate"], "reference/reference.py": ref["reference_py"],
             "reference/input.py": ref["input_py"], "reference/shapes.json": json.dumps(ref["shapes"]),
             "reference/metadata.json": json.dumps(ref.get("metadata") or {})}
    if "roofline" in ref:
        files["reference/roofline.json"] = json.dumps(ref["roofline"])
    write_files(workdir, files)


class Eval:
    """Atrex-Bench's evaluator on the candidate; the result is its eval_result.json."""

    def __init__(self, lim: L.Limits, accepted: frozenset[str], runner: Path) -> None:
        self.lim, self.accepted, self.runner = lim, accepted, runner

    def validate(self, payload: Any) -> tuple[dict[str, Any], str | None, str | None]:
        req = _bundle(payload, self.lim, self.accepted)
        if req["mode"] not in ("full", "correctness_only"):
            raise L.BadRequest("invalid_mode", "mode must be 'full' or 'correctness_only'")
        p = L.obj(payload)
        return req, L.idempotency_key(p), p.get("author") if isinstance(p.get("author"), str) else None

    def argv(self, request: dict[str, Any], workdir: Path, bench_iters: int | None = None
             ) -> list[str]:
        o = request["options"]
        iters = bench_iters or (1 if request["mode"] == "correctness_only" else
                                o.get("bench_iters", 100))
        argv = [sys.executable, str(self.runner), "--input", str(workdir / "candidate.py"),
                "--reference-dir", str(workdir / "reference"), "--output",
                str(workdir / "eval_output"), "--atol", str(o.get("atol", 1e-2)),
                "--rtol", str(o.get("rtol", 0.05)),
                "--num-correctness-cases", str(o.get("num_correctness_cases", 1)),
                "--bench-iters", str(iters)]
        return argv + (["--clock-locked"] if request["lock_clocks"] else [])

    def prepare(self, request: dict[str, Any], workdir: Path) -> tuple[list[str], float]:
        _materialize(request, workdir)
        return self.argv(request, workdir), float(request["timeout_s"])

    def complete(self, request: dict[str, Any], workdir: Path, result: dict[str, Any]
                 ) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
        found = sorted((workdir / "eval_output").rglob("eval_result.json"))
        if result["exit_code"] != 0 or not found:
            return "failed", result, error("evaluator_failed", f"the evaluator exited "
                                           f"{result['exit_code']} without eval_result.json"
                                           if not found else "the evaluator failed")
        payload = json.loads(found[0].read_text())
        payload["krex"] = {"regions": result["regions"], **result["krex"]}
        return "succeeded", payload, None


class Profile(Eval):
    """ncu around the evaluator's run of the candidate (one bench iteration); kernels from CSV."""

    def __init__(self, lim: L.Limits, accepted: frozenset[str], runner: Path, ncu: str) -> None:
        super().__init__(lim, accepted, runner)
        self.ncu = ncu

    def validate(self, payload: Any) -> tuple[dict[str, Any], str | None, str | None]:
        req, key, author = Eval.validate(self, {**L.obj(payload), "mode": "full"})
        if req["level"] not in PROFILE_LEVELS:
            raise L.BadRequest("invalid_level", f"level must be one of {', '.join(PROFILE_LEVELS)}")
        req["mode"] = None
        return req, key, author

    def prepare(self, request: dict[str, Any], workdir: Path) -> tuple[list[str], float]:
        _materialize(request, workdir)
        argv = [self.ncu, "--csv", "--log-file", str(workdir / "ncu.csv"), "--target-processes",
                "all", "--metrics", ",".join(NCU_METRICS[:1] if request["level"] == "survey"
                                             else NCU_METRICS)]
        if request.get("kernel_regex"):
            argv += ["--kernel-name", f"regex:{request['kernel_regex']}"]
        request = {**request, "mode": "full"}
        return argv + self.argv(request, workdir, bench_iters=1), float(request["timeout_s"])

    def complete(self, request: dict[str, Any], workdir: Path, result: dict[str, Any]
                 ) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
        path = workdir / "ncu.csv"
        if result["exit_code"] != 0 or not path.is_file():
            return "failed", result, error("profiler_failed",
                                           f"ncu exited {result['exit_code']}")
        text = path.read_text(errors="replace")
        lines = text.splitlines()
        start = next((i for i, ln in enumerate(lines) if "Kernel Name" in ln), None)
        kernels: dict[str, dict[str, Any]] = {}
        if start is not None:
            for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
                name = (row.get("Kernel Name") or "").strip()
                if name:
                    k = kernels.setdefault(name, {"name": name, "metrics": {}})
                    k["metrics"][row.get("Metric Name", "")] = row.get("Metric Value")
        return "succeeded", {"profiler": "ncu", "level": request["level"],
                             "kernels": list(kernels.values()),
                             "krex": {"regions": result["regions"], **result["krex"]}}, None


def build(lim: L.Limits, accepted: frozenset[str], atrex_bench_root: str | None
          ) -> tuple[dict[str, Any], dict[str, str]]:
    """(runnable kinds by name, unavailable kinds -> why)."""
    kinds: dict[str, Any] = {"dev": Dev(lim, accepted)}
    missing = {"disassemble": "the krex gateway does not implement disassemble jobs"}
    runner, why = find_evaluator(atrex_bench_root)
    ncu = shutil.which("ncu")
    if runner is not None:
        kinds["eval"] = Eval(lim, accepted, runner)
    else:
        missing["eval"] = why
    if runner is not None and ncu:
        kinds["profile"] = Profile(lim, accepted, runner, ncu)
    else:
        missing["profile"] = "; ".join(x for x in ("" if ncu else "ncu is not on PATH", why) if x)
    return kinds, missing
