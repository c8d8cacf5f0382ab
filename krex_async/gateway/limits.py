"""The gateway's limits and the checks that turn an HTTP request body into a typed job request.

Every check raises `Invalid(reason, message)`; the app answers it as a JSON error with that reason
and status 422, as the reference gateway answers a request that fails validation (a size over a
limit included: only a body over --max-body is 413). Nothing here touches the
filesystem: file paths are checked as strings, and `jobs.write_files` refuses what a string check
cannot see (an existing symlink or file in the way).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

MiB = 1024 * 1024
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
KINDS = ("dev", "eval", "profile", "disassemble")
STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
# Variables a job may not set: they would point its commands at another daemon or identity.
RESERVED_ENV = frozenset({"KREX_SOCKET", "KREX_COMMAND", "KREX_TOKEN", "KREX_DEVICE"})


@dataclass(frozen=True)
class Limits:
    """Sizes in bytes, times in seconds. One instance per gateway, from the command line."""

    max_body: int = 32 * MiB
    max_file: int = 8 * MiB
    max_files: int = 256
    max_files_total: int = 24 * MiB
    max_command: int = 1 * MiB
    max_output: int = 32 * MiB  # per stream, as the reference; beyond it the job fails
    max_timeout: float = 600.0
    default_timeout: float = 600.0
    max_env: int = 256
    max_wait: float = 300.0  # long-poll cap
    max_running: int = 16  # jobs submitted to the daemon at once; the rest stay queued


# --max-running auto: the gateway submits up to this many and the daemon's admission decides which
# start (the rest wait in its queue, each with its reason); under its default --mem-commit auto,
# memory holds none of these jobs' first runs back (docs/admission.md, "The gateway")
AUTO_MAX_RUNNING = 64


def max_running_arg(text: str) -> int:
    """--max-running: a number of jobs at least 1, or `auto` (AUTO_MAX_RUNNING). ValueError else."""
    if text.strip().lower() == "auto":
        return AUTO_MAX_RUNNING
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"--max-running {text!r}: expected a number of jobs or auto") from None
    if n < 1:
        raise ValueError("--max-running must be at least 1")
    return n


class BadRequest(Exception):
    """A request the gateway will not run: `reason` is machine-readable, `status` the HTTP code."""

    def __init__(self, reason: str, message: str, status: int = 400, **details: Any) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.status = status
        self.details = details


class Invalid(BadRequest):
    """A job request that fails validation: 422, whatever the check."""

    def __init__(self, reason: str, message: str, **details: Any) -> None:
        super().__init__(reason, message, 422, **details)


@dataclass
class DevRequest:
    command: str
    files: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 600.0
    targets: list[str] = field(default_factory=list)
    idempotency_key: str | None = None
    author: str | None = None


def obj(payload: Any, where: str = "request body") -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise Invalid("invalid_request", f"{where} must be a JSON object")
    return payload


def targets(payload: dict[str, Any], accepted: frozenset[str]) -> list[str]:
    """spec.target_hardware: a non-empty list of names, at least one of them ours."""
    spec = payload.get("spec")
    hw = spec.get("target_hardware") if isinstance(spec, dict) else None
    if not isinstance(hw, list) or not hw or not all(isinstance(h, str) and h for h in hw):
        raise Invalid("invalid_target_hardware", "spec.target_hardware must be a non-empty array of strings")
    if not any(h in accepted for h in hw):
        raise Invalid(
            "unsupported_hardware",
            f"this gateway runs on: {', '.join(sorted(accepted))}; got {hw}",
            accepted=sorted(accepted),
        )
    return hw


def timeout(value: Any, lim: Limits, name: str = "timeout_s") -> float:
    if value is None:
        return lim.default_timeout
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 < value <= lim.max_timeout
    ):
        raise Invalid("invalid_timeout", f"{name} must be a number of seconds in (0, {lim.max_timeout:g}]")
    return float(value)


def env_vars(value: Any, lim: Limits) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > lim.max_env:
        raise Invalid(
            "invalid_env_vars", f"env_vars must be an object of at most {lim.max_env} string values"
        )
    for k, v in value.items():
        if not ENV_NAME.match(k) or not isinstance(v, str) or "\x00" in v:
            raise Invalid(
                "invalid_env_vars", f"env_vars[{k!r}] must be a valid name with a string value without NUL"
            )
        if k in RESERVED_ENV:
            raise Invalid("invalid_env_vars", f"env_vars may not set {k}: krex sets it")
    return dict(value)


def idempotency_key(payload: dict[str, Any]) -> str | None:
    key = payload.get("idempotency_key")
    if key is not None and (not isinstance(key, str) or not key or len(key) > 256):
        raise Invalid(
            "invalid_idempotency_key", "idempotency_key must be a non-empty string of at most 256 characters"
        )
    return key


def safe_path(name: Any) -> str:
    """A relative path of plain components: no absolute path, '.', '..', empty part, or NUL."""
    if not isinstance(name, str) or not name:
        raise Invalid("unsafe_path", "file names must be non-empty strings")
    if "\x00" in name or "\\" in name:
        raise Invalid("unsafe_path", f"file name {name!r} contains NUL or a backslash")
    if name.startswith("/"):
        raise Invalid("unsafe_path", f"file name {name!r} is absolute")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise Invalid(
            "unsafe_path", f"file name {name!r} must be a plain relative path (no '', '.' or '..' components)"
        )
    if len(name) > 4096 or any(len(p.encode()) > 255 for p in parts):
        raise Invalid("unsafe_path", f"file name {name[:64]!r}... is too long")
    return name


def files(value: Any, lim: Limits) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Invalid("invalid_files", "files must map relative paths to text contents")
    if len(value) > lim.max_files:
        raise Invalid("too_many_files", f"at most {lim.max_files} files per job")
    total = 0
    for name, content in value.items():
        safe_path(name)
        if not isinstance(content, str):
            raise Invalid("invalid_files", f"files[{name!r}] must be a text string")
        n = len(content.encode("utf-8", "surrogatepass"))
        if n > lim.max_file:
            raise Invalid("file_too_large", f"files[{name!r}] is {n} bytes; the limit is {lim.max_file}")
        total += n
    if total > lim.max_files_total:
        raise Invalid("files_too_large", f"files total {total} bytes; the limit is {lim.max_files_total}")
    names = set(value)
    for name in names:  # "a" and "a/b" cannot both be files
        parts = name.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in names:
                raise Invalid(
                    "unsafe_path", f"{'/'.join(parts[:i])!r} is both a file and the directory of {name!r}"
                )
    return dict(value)


def dev_request(payload: Any, lim: Limits, accepted: frozenset[str]) -> DevRequest:
    p = obj(payload)
    hw = targets(p, accepted)
    command = p.get("command")
    if not isinstance(command, str) or not command.strip():
        raise Invalid("invalid_command", "command must be a non-empty string")
    if "\x00" in command:
        raise Invalid("invalid_command", "command contains a NUL character")
    if len(command.encode()) > lim.max_command:
        raise Invalid("command_too_large", f"command exceeds {lim.max_command} bytes")
    author = p.get("author")
    return DevRequest(
        command=command,
        files=files(p.get("files"), lim),
        env_vars=env_vars(p.get("env_vars"), lim),
        timeout_s=timeout(p.get("timeout_s"), lim),
        targets=hw,
        idempotency_key=idempotency_key(p),
        author=author if isinstance(author, str) else None,
    )
