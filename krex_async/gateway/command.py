"""A job as a krex command: the environment it runs in (job_env, with `python` shims on its PATH)
and the result dict its command's report and output become (command_result). JobRunner (jobs.py)
submits and watches; this is what it hands the daemon and what it reads back.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shlex
import sys
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import msgspec

from krex_async import protocol as P
from krex_async.client.submit import CommandHandle
from krex_async.gateway.auth import RunAs
from krex_async.gateway.limits import RESERVED_ENV

PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent.parent)
SECRET_ENV = frozenset({"KREX_GATEWAY_TOKEN", "AGATE_TOKEN"})  # the gateway's, never a job's
# What a job inherits from the gateway's environment (docs/gateway-security.md): the locale, the
# search paths, and the variables that configure krex and the GPU stack. Anything else (an
# operator's secret in a root gateway's environment) stays out unless --job-env names it.
PASS_ENV = frozenset({"PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR"})
PASS_PREFIXES = ("LC_", "KREX_", "CUDA_", "NVIDIA_", "NCCL_", "TRITON_", "TORCH_")
GATEWAY_PREFIX = "KREX_GATEWAY_"  # the gateway's own settings: not a job's


def make_shims(bindir: Path, python: str = sys.executable) -> Path:
    """<state>/bin/python and python3: run `python` (images often lack a `python`).

    Scripts, not symlinks: a venv's interpreter finds its environment only when called by its path.
    The directory and the scripts are the gateway user's (files.prepare_state): no job changes them.
    """
    bindir.mkdir(mode=0o755, exist_ok=True)
    for name in ("python", "python3"):
        tmp = bindir / f".{name}.new"
        tmp.unlink(missing_ok=True)
        tmp.write_text(f'#!/bin/sh\nexec {shlex.quote(python)} "$@"\n')
        tmp.chmod(0o755)
        tmp.replace(bindir / name)
    return bindir


def passed_env(source: Mapping[str, str], names: Collection[str] = ()) -> dict[str, str]:
    """The gateway's variables a job inherits: PASS_ENV, PASS_PREFIXES and the operator's `names`
    (--job-env), never a secret, a reserved variable or the gateway's own configuration."""
    return {
        k: v
        for k, v in source.items()
        if (k in PASS_ENV or k.startswith(PASS_PREFIXES) or k in names)
        and k not in RESERVED_ENV
        and k not in SECRET_ENV
        and not (k.startswith(GATEWAY_PREFIX) and k not in names)
    }


def job_env(
    job_id: str,
    workdir: Path,
    extra: dict[str, str],
    shims: Path | None = None,
    python: str = sys.executable,
    user: RunAs | None = None,
    names: Collection[str] = (),
) -> dict[str, str]:
    """A minimal environment (passed_env: a root gateway's other variables, an operator's
    secrets among them, never reach a job), the user's name and a HOME it can write (its own, else
    the job directory), the job's variables, and what krex and the API add."""
    env = passed_env(os.environ, names)
    if user is not None and user.uid is not None:
        name, home = user.name, user.home or str(workdir)
    else:  # the gateway's own user
        name, own = _me()
        home = own or os.environ.get("HOME") or str(workdir)
    env.update(HOME=home, USER=name, LOGNAME=name)
    env.update(extra)
    env.setdefault("KREX_AUTO_REGION", "1")
    env["ATREX_LOCAL_JOB_ID"] = env["KREX_GATEWAY_JOB"] = job_id
    if "PATH" not in extra:  # `python` (and python3) in a job is the gateway's interpreter
        first = [str(shims)] if shims is not None else []
        first.append(str(Path(python).parent))
        env["PATH"] = os.pathsep.join(
            first + [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p and p not in first]
        )
    if "TORCH_EXTENSIONS_DIR" not in extra:  # torch's build locks survive SIGKILL: keep them local
        env["TORCH_EXTENSIONS_DIR"] = str(workdir / ".torch_extensions")
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if PACKAGE_ROOT not in parts:  # `from krex_async import region` works in every job
        parts.append(PACKAGE_ROOT)
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def _me() -> tuple[str, str | None]:
    """The gateway user's name and its home (None when it has no passwd entry)."""
    try:
        pw = pwd.getpwuid(os.geteuid())
    except KeyError:
        return str(os.geteuid()), None
    return pw.pw_name, pw.pw_dir


def command_result(
    handle: CommandHandle, report: Any, out: bytearray, err: bytearray, out_cut: bool, err_cut: bool
) -> dict[str, Any]:
    rep = msgspec.to_builtins(report)
    stderr = err.decode("utf-8", "replace")
    if report.state == "lost":  # its node died: the Atrex client prints stderr, not the error
        stderr += (
            "\n" if stderr and not stderr.endswith("\n") else ""
        ) + f"krex: the job failed: {report.error}\n"
    return {
        "exit_code": report.exit_code if report.signal is None else -report.signal,
        "stdout": out.decode("utf-8", "replace"),
        "stderr": stderr,
        "stdout_truncated": out_cut,
        "stderr_truncated": err_cut,
        "regions": rep.get("regions", []),
        "krex": {
            k: getattr(report, k)
            for k in (
                "command",
                "device",
                "policy",
                "state",
                "signal",
                "wall_s",
                "queued_s",
                "start_latency_s",
                "error",
                "stdout_bytes",
                "stderr_bytes",
                "via",
                "pool_adopted",
                "pool_declined",
                "reruns",  # memory admission: re-run after a co-located CUDA out-of-memory
                "rerun_reason",
                "oom",  # "co-located" or "alone" where it failed so
                "mem_need",  # bytes it was taken to need, and whence (learned, default, ...)
                "mem_source",
                "mem_peak",  # the most its processes were seen to hold on the device
                "gate_s",  # --mem-gate: how long its first CUDA use waited for admission
                "gate",
            )
        },
    }


def job_shape(request: dict[str, Any]) -> str:
    """A digest of what makes jobs alike in memory: the command and the names of the files (not
    their contents, which an agent changes from candidate to candidate of one problem)."""
    files = request.get("files") or {}
    return _digest([request.get("command"), sorted(files) if isinstance(files, dict) else []])


CONTENT = ("candidate", "command", "files", "reference")  # the request fields that make up a job


def job_features(request: dict[str, Any]) -> list[str]:
    """What a job shares with others, each a digest of content: its command and each of its files
    (name and content); an eval's reference and candidate. An agent's next candidate for a problem
    shares the problem's files, not the candidate's: the daemon takes a job to need what the earlier
    jobs that shared such a feature peaked at (footprints.py). The first MAX_ALIKE, in order of
    field and file name."""
    out = []
    for field in CONTENT:
        value = request.get(field)
        if field == "files" and isinstance(value, dict):
            out += [f"file {name[:64]} {_digest([name, text])}" for name, text in sorted(value.items())]
        elif value is not None:
            out.append(f"{field} {_digest(value)}")
    return out[: P.MAX_ALIKE]


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def admission_args(kind: str, request: dict[str, Any]) -> dict[str, Any]:
    """A job's Submit fields for a daemon's (not a fleet's) memory admission: it is taken to need
    what the last jobs that shared its problem's files (an agent's earlier candidates for it)
    peaked at, or the typical peak of its own shape until one ran; one that ran out of memory
    beside others is run again alone (jobs are evaluations: running one twice is safe), its output
    replacing the first's."""
    return {
        "mem_key": f"gateway {kind} / {job_shape(request)}",
        "mem_alike": job_features(request),
        "rerun_on_oom": True,
    }
