"""On the GPU host: eval and profile jobs through the krex gateway with a real Atrex-Bench checkout
and, where it is installed, a real ncu, sent as the Atrex client (tools/sandbox.py) sends them.

    python -m bench.gateway_profile_check --atrex-bench-root PATH [--operator fused_add_rms_norm]
                                          [--shapes 2] [--deep] [--out DIR]

Jobs: eval of the operator's reference as the candidate (every shape must pass); eval of a broken
candidate (the reference with its outputs zeroed: correctness fails, the evaluator exits 1, and the
job must still succeed with the failures, as the reference gateway reports it); eval with
lock_clocks; then, with ncu, profiles at level sol (top_kernels 5) and survey, and with --deep a
deep profile of the top kernel. Without ncu it says so and checks that profile answers 501 saying
why. Writes OUT/gateway_profile_check.json (default $OUT, else ./out) and prints one line per job.
As root the jobs run as `krexbench` (bench/harness/stack.py): ncu then needs profiling rights for
non-admin users (NVreg_RestrictProfilingToAdminUsers=0), which the output names if it is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.output import module_prog, write_json
from bench.harness.stack import Stack
from krex_async.gateway.profile import find_tool

ROOT = Path(__file__).resolve().parent.parent

BREAK = """

import torch as _krex_torch
_KrexReference = Model


def _krex_zero(value):
    if isinstance(value, _krex_torch.Tensor):
        return _krex_torch.zeros_like(value) + 1.0
    if isinstance(value, (tuple, list)):
        return type(value)(_krex_zero(v) for v in value)
    if isinstance(value, dict):  # fused_add_rms_norm returns {"out": ..., "residual": ...}
        return {k: _krex_zero(v) for k, v in value.items()}
    return value


class Model(_KrexReference):  # the reference, with every output replaced: fails correctness
    def forward(self, *args, **kwargs):
        return _krex_zero(super().forward(*args, **kwargs))
"""


def request(op_dir: Path, candidate: str, shapes: int, **extra: Any) -> dict[str, Any]:
    """The typed request, as tools/sandbox.py's _typed_request builds it from a workspace."""
    all_shapes = json.loads((op_dir / "shapes.json").read_text())
    keep = {k: all_shapes[k] for k in list(all_shapes)[:shapes]}
    ref: dict[str, Any] = {
        "operator": op_dir.name,
        "reference_py": (op_dir / "reference.py").read_text(),
        "input_py": (op_dir / "input.py").read_text(),
        "shapes": keep,
    }
    for name, field in (("metadata.json", "metadata"), ("roofline.json", "roofline")):
        if (op_dir / name).is_file():
            value = json.loads((op_dir / name).read_text())
            if isinstance(value.get("shapes"), dict):
                value["shapes"] = {k: v for k, v in value["shapes"].items() if k in keep}
            if "num_shapes" in value:
                value["num_shapes"] = len(keep)
            ref[field] = value
    return {
        "name": f"{op_dir.name}_check",
        "spec": {"languages": [], "target_hardware": ["local"]},
        "candidate": candidate,
        "reference": ref,
        "options": {
            "num_correctness_cases": 1,
            "bench_iters": 20,
            "atol": 0.01,
            "rtol": 0.05,
            "timeout_s": 300,
        },
        "env_vars": {},
        **extra,
    }


def summary(kind: str, job: dict[str, Any]) -> dict[str, Any]:
    r = job.get("result") or {}
    out: dict[str, Any] = {"status": job["status"], "error": job.get("error")}
    if kind == "eval" and isinstance(r.get("passed"), dict):
        out["correctness"] = {k: v.get("status") for k, v in (r["passed"].get("correctness") or {}).items()}
        # run_eval.py writes it under "environment" (_build_environment)
        out["clock_locked"] = (r.get("environment") or {}).get("clock_locked")
    if kind == "profile":
        out["kernels"] = [
            {k: v for k, v in kern.items() if k not in ("metrics", "diagnostics")}
            for kern in r.get("kernels", [])[:5]
        ]
        out["note"] = r.get("note")
    if job["status"] != "succeeded":
        out["stderr_tail"] = (r.get("stderr") or "")[-3000:]
    out["regions"] = len((r.get("krex") or {}).get("regions", []))
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    bench_root = Path(args.atrex_bench_root).resolve()
    op_dir = bench_root / "data" / args.operator
    tmp = Path(tempfile.mkdtemp(prefix="gwcheck-"))
    # The jobs' user must read the evaluator: a copy of scripts/ and src/ where it can.
    copy = tmp / "atrex-bench"
    for part in ("scripts", "src"):
        shutil.copytree(bench_root / part, copy / part)
    for d, _, files in os.walk(copy):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    copy.parent.chmod(0o711)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(copy / "src"), os.environ.get("PYTHONPATH", "")) if p
    )
    ncu = find_tool("ncu")
    report: dict[str, Any] = {"ncu": ncu, "operator": args.operator, "jobs": {}}
    st = Stack(
        ["--devices", "auto", "--log-level", "warning"],
        4,
        policy="region",
        gateway_args=("--atrex-bench-root", str(copy)),
        parent=tmp,
    ).start()
    try:
        async with st.client() as c:
            report["env"] = await c.env()
            reference = (op_dir / "reference.py").read_text()
            plan: list[tuple[str, str, dict[str, Any]]] = [
                ("eval-pass", "eval", request(op_dir, reference, args.shapes, mode="full")),
                ("eval-broken", "eval", request(op_dir, reference + BREAK, args.shapes, mode="full")),
                (
                    "eval-lock-clocks",
                    "eval",
                    request(op_dir, reference, args.shapes, mode="full", lock_clocks=True),
                ),
            ]
            if ncu:
                plan += [
                    (
                        "profile-sol",
                        "profile",
                        request(op_dir, reference, args.shapes, level="sol", top_kernels=5),
                    ),
                    ("profile-survey", "profile", request(op_dir, reference, args.shapes, level="survey")),
                ]
            else:
                status, body = await c.request("POST", "/v1/jobs/profile", json=request(op_dir, reference, 1))
                report["profile_without_ncu"] = {"http": status, "body": body}
                print(
                    f"ncu is not installed here: profile answers {status} "
                    f"{body.get('reason') if isinstance(body, dict) else body}: "
                    f"{body.get('message') if isinstance(body, dict) else ''}"
                )
            deep = args.deep or "profile-deep" in (args.only or ())
            for name, kind, payload in plan:
                # the deep profile's kernel comes from the sol profile's top kernel
                if not args.only or name in args.only or (deep and name == "profile-sol"):
                    await one(c, report, name, kind, payload)
            sol = report["jobs"].get("profile-sol", {}).get("summary", {}).get("kernels") or []
            if deep and not sol:
                print("profile-deep: not run (no kernel from the sol profile to name)")
            if deep and sol:
                await one(
                    c,
                    report,
                    "profile-deep",
                    "profile",
                    request(
                        op_dir,
                        reference,
                        args.shapes,
                        level="deep",
                        kernel_regex=re.escape(function_name(sol[0]["name"])),
                    ),
                )
    finally:
        report["gateway_log"] = st.gateway.tail(4000)
        st.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def function_name(demangled: str) -> str:
    """A kernel's function name from ncu's demangled one, as an agent names it in kernel_regex:
    "void at::native::elementwise_kernel<128, 2, ...>(int, T3)" -> "at::native::elementwise_kernel".
    (The whole demangled signature, escaped, matched nothing on the H200: 0 kernels in 4.6 s.)"""
    name = demangled.strip()
    if name.startswith("void "):
        name = name[len("void ") :]
    return re.split(r"[<(]", name, maxsplit=1)[0].strip() or name


async def one(c: Any, report: dict[str, Any], name: str, kind: str, payload: dict[str, Any]) -> None:
    t = time.monotonic()
    status, job = await c.request("POST", f"/v1/jobs/{kind}", json=payload)
    if status != 202:
        report["jobs"][name] = {"http": status, "body": job}
        print(f"{name:18s} HTTP {status}: {job}")
        return
    job = await c.wait(job["job_id"], 900)
    s = summary(kind, job)
    report["jobs"][name] = {"job_id": job["job_id"], "wall_s": round(time.monotonic() - t, 1), "summary": s}
    detail = s.get("correctness") or [k.get("name", "")[:40] for k in s.get("kernels", [])]
    print(
        f"{name:18s} {s['status']:9s} {report['jobs'][name]['wall_s']:6.1f} s  "
        f"{(s['error'] or {}).get('reason', '')} {detail}",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(prog=module_prog(__spec__), description=__doc__.split("\n")[0])
    ap.add_argument("--atrex-bench-root", default=os.environ.get("ATREX_BENCH_ROOT"))
    ap.add_argument("--operator", default="fused_add_rms_norm")
    ap.add_argument("--shapes", type=int, default=2, help="first N shapes of the operator")
    ap.add_argument("--deep", action="store_true", help="also a deep profile of the top kernel")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--only", nargs="+", choices=JOBS, help="run these jobs only")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(args.atrex_bench_root or "")
    if not args.atrex_bench_root or not (root / "scripts" / "run_eval.py").is_file():
        print(
            "no Atrex-Bench checkout: pass --atrex-bench-root (or set ATREX_BENCH_ROOT) to a "
            "checkout with scripts/run_eval.py; nothing was run",
            file=sys.stderr,
        )
        write_json(
            out / "gateway_profile_check.json",
            {"error": "no Atrex-Bench checkout", "ncu": find_tool("ncu")},
            indent=None,
        )
        return 2
    if not (root / "data" / args.operator / "shapes.json").is_file():
        print(f"no operator {args.operator!r} under {root}/data", file=sys.stderr)
        return 2
    report = asyncio.run(run(args))
    report["verdicts"] = verdicts(report["jobs"])
    write_json(out / "gateway_profile_check.json", report, default=str)
    for name, (ok, why) in report["verdicts"].items():
        print(f"{'PASS' if ok else 'FAIL'} {name}: {why}")
    bad = [n for n, (ok, _) in report["verdicts"].items() if not ok]
    print(
        f"wrote {out / 'gateway_profile_check.json'}; "
        f"{'all as expected' if not bad else 'FAILED: ' + ', '.join(bad)}"
    )
    return 0 if not bad else 1


JOBS = ("eval-pass", "eval-broken", "eval-lock-clocks", "profile-sol", "profile-survey", "profile-deep")


def verdicts(jobs: dict[str, Any]) -> dict[str, tuple[bool, str]]:
    """What each job must show, as the reference gateway reports it: the reference as candidate
    passes every shape; the broken candidate's job succeeds with the failures in its result (the
    evaluator exits 1); lock_clocks locks them; a profile names kernels."""
    out: dict[str, tuple[bool, str]] = {}
    for name, job in jobs.items():
        s = job.get("summary") or {}
        st, corr = s.get("status"), s.get("correctness") or {}
        if st != "succeeded":
            out[name] = (False, f"status {st}, error {s.get('error')}")
        elif name == "eval-broken":
            failed = sorted(k for k, v in corr.items() if v != "passed")
            out[name] = (
                bool(failed),
                f"shapes failing correctness: {failed or 'none (the break did not show)'}",
            )
        elif name.startswith("eval"):
            ok = bool(corr) and all(v == "passed" for v in corr.values())
            if name == "eval-lock-clocks":
                ok = ok and s.get("clock_locked") is True
            out[name] = (ok, f"correctness {corr}, clock_locked {s.get('clock_locked')}")
        else:
            out[name] = (bool(s.get("kernels")), f"{len(s.get('kernels') or [])} kernels")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
