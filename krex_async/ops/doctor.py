"""`krex doctor [--json] [--gpu]`: what works on this node for krex, what does not, and the fix.

Each check gives a verdict (ok, warn, fail), a one-line detail and, unless ok, the fix. The exit
status answers one question: can this node run the `region` policy with full isolation, i.e. is there
a writable cgroup v2 subtree with a working freezer AND a cpuset (v2 controller, or the v1 hierarchy
on a hybrid host)? 0 yes, 1 no, 2 for a usage error.

Checks that touch the kernel clean up after themselves: the test cgroups are created under the
subtree the daemon would use, named `krex-doctor-<pid>`, and removed in `finally` (with their test
process killed); bcc, NVML, AMD SMI and CUDA run in subprocesses with timeouts, so a broken library
costs one check, never the doctor. The cgroup checks live in doctor_cgroup.py, the kernel, BPF and
GPU checks in doctor_kernel.py.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import sys
from dataclasses import asdict

# the cgroup checks, moved to doctor_cgroup.py, are still importable from here
from krex_async.ops.doctor_cgroup import SERVICE_CGROUP, check_backend, check_cgroups, v2_subtree
from krex_async.ops.doctor_check import FAIL, OK, WARN, Check

#: distribution name, import name, required?, what it is for
PACKAGES = [
    ("krex", "krex_async", True, "this package"),
    ("uvloop", "uvloop", True, "the daemon's event loop (asyncio works without it, slower)"),
    ("msgspec", "msgspec", True, "protocol and config decoding"),
    ("structlog", "structlog", True, "logs"),
    ("psutil", "psutil", True, "process trees"),
    ("nvidia-ml-py", "pynvml", False, "NVIDIA GPUs (pip install 'krex[nvidia]')"),
    ("amdsmi", "amdsmi", False, "AMD GPUs (pip install 'krex[amd]', needs ROCm)"),
    ("prometheus-client", "prometheus_client", False, "--metrics (pip install 'krex[metrics]')"),
]


# ---------------------------------------------------------------------------------- python


def check_python() -> list[Check]:
    out = [
        Check(
            "python",
            OK if sys.version_info >= (3, 11) else FAIL,
            f"{sys.version.split()[0]} at {sys.executable}",
            "" if sys.version_info >= (3, 11) else "krex needs Python 3.11 or newer",
        )
    ]
    for dist, mod, required, why in PACKAGES:
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            version = ""
        if mod == "amdsmi" and version:  # its import prints to stdout and may raise KeyError:
            out.append(
                Check(
                    f"package {dist}",
                    OK,
                    f"{version} ({why}; usable: see `gpu amd`)",
                    data={"version": version},
                )
            )  # the GPU check imports it in a child
            continue
        try:
            __import__(mod)
            importable, err = True, ""
        except Exception as e:  # anything the import raises means "not usable"
            importable, err = False, f"{type(e).__name__}: {e}"
        if importable:
            out.append(
                Check(f"package {dist}", OK, f"{version or 'importable'} ({why})", data={"version": version})
            )
        elif version:
            out.append(
                Check(
                    f"package {dist}",
                    FAIL if required else WARN,
                    f"{version} installed but import fails: {err}",
                    f"reinstall {dist} or install what it needs ({why})",
                    {"version": version},
                )
            )
        else:
            out.append(
                Check(
                    f"package {dist}",
                    FAIL if required else WARN,
                    "not installed" + ("" if required else f" (optional: {why})"),
                    f"pip install {dist}",
                )
            )
    return out


def check_uvloop() -> Check:
    try:
        import uvloop
    except ImportError as e:
        return Check(
            "uvloop", WARN, f"not importable ({e}): the daemon falls back to asyncio", "pip install uvloop"
        )
    return Check("uvloop", OK, f"uvloop {uvloop.__version__} will run the event loop")


# ------------------------------------------------------------------------------------- CLI


def run_checks(gpu: bool = False, cgroup_root: str = "") -> list[Check]:
    from krex_async.ops import doctor_kernel as k

    checks = [
        *check_python(),
        check_uvloop(),
        *check_cgroups(cgroup_root),
        check_backend(cgroup_root),
        *k.check_tracing(),
        *k.check_bpf(),
        *k.check_gpus(),
        k.check_driver_lock(),
    ]
    if gpu:
        checks.append(k.check_cuda_context())
    return checks


FULL_ISOLATION = ("cgroup writable", "cgroup freezer", "cpuset", "isolation backend")


def full_isolation(checks: list[Check]) -> bool:
    """The node can freeze (v2 freezer in a writable subtree) and fence cores (cpuset), and this
    installation's `--isolation auto` would use them (the cgroup backend, not the signal fallback)."""
    by = {c.name: c for c in checks}
    return all(n in by and by[n].verdict == OK for n in FULL_ISOLATION)


def render(checks: list[Check]) -> str:
    w = max(len(c.name) for c in checks)
    lines = [f"{'CHECK':<{w}}  {'':4}  DETAIL"]
    for c in checks:
        lines.append(f"{c.name:<{w}}  {c.verdict.upper():<4}  {c.detail}")
        if c.fix and c.verdict != OK:
            lines.append(f"{'':<{w}}        fix: {c.fix}")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    p = subparsers.add_parser("doctor", help="check what krex can do on this node, and how to fix it")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--gpu", action="store_true", help="also time CUDA context creation")
    p.add_argument("--cgroup-root", default="", help="the cgroup root the daemon is configured with")
    return p


def main(args: argparse.Namespace) -> int:
    """Run every check and print them; 0 when the region policy gets full isolation here, else 1;
    130 on Ctrl-C (each check's test cgroup and processes are removed in its own `finally`)."""
    try:
        checks = run_checks(gpu=args.gpu, cgroup_root=args.cgroup_root)
    except KeyboardInterrupt:
        print("krex doctor: interrupted; no check result is printed", file=sys.stderr)
        return 130
    full = full_isolation(checks)
    if args.json:
        print(
            json.dumps(
                {"full_isolation": full, "exit": 0 if full else 1, "checks": [asdict(c) for c in checks]},
                indent=2,
            )
        )
    else:
        print(render(checks))
        missing = [c.name for c in checks if c.name in FULL_ISOLATION and c.verdict != OK]
        print(
            "\nregion policy with full isolation (cgroup backend, freezer, cpuset): "
            + ("yes" if full else f"NO ({', '.join(missing)}: see above)")
        )
    return 0 if full else 1


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="krex")
    sub = ap.add_subparsers(dest="verb", required=True)
    add_parser(sub)
    return main(ap.parse_args(["doctor", *(sys.argv[1:] if argv is None else argv)]))


__all__ = [
    "FULL_ISOLATION",
    "PACKAGES",
    "SERVICE_CGROUP",
    "Check",
    "add_parser",
    "check_backend",
    "check_cgroups",
    "check_python",
    "check_uvloop",
    "full_isolation",
    "main",
    "render",
    "run_checks",
    "v2_subtree",
]

if __name__ == "__main__":
    sys.exit(_main())
