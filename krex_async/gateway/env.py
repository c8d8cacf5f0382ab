"""GET /v1/env: what this node offers, probed once (in a thread) and cached until `force=true`.

The GPUs come from the daemon (`status`: its devices), the driver from nvidia-smi, the toolkit from
`nvcc --version`, Python from this interpreter, and torch / triton versions from their installed
distributions (importlib.metadata: nothing is imported, no GPU context is made by the gateway).
A probe that fails leaves its field None and adds its reason to `probe_error`; it never fails the
request.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import platform
import re
import shutil
import subprocess
import time
from datetime import UTC, datetime
from typing import Any

from krex_async import __version__


def _run(argv: list[str], timeout: float = 10.0) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=True).stdout


def probe_host() -> tuple[dict[str, Any], list[str]]:
    """Blocking: driver, toolkit and framework versions. Returns (fields, errors)."""
    errors: list[str] = []
    out: dict[str, Any] = {
        "driver_version": None,
        "gpu_model": None,
        "total_memory_mb": None,
        "vendor": "unknown",
        "arch": None,
    }
    tool: dict[str, Any] = {"python": platform.python_version(), "krex": __version__}
    if shutil.which("nvidia-smi"):
        try:
            first = _run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,memory.total,driver_version",
                    "--format=csv,noheader,nounits",
                ]
            ).splitlines()[0]
            name, mem, driver = (p.strip() for p in first.split(",", 2))
            out.update(
                vendor="nvidia", gpu_model=name, total_memory_mb=int(float(mem)), driver_version=driver
            )
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
            errors.append(f"nvidia-smi: {e}")
        try:  # a separate query: older drivers do not know compute_cap
            cap = _run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]).split()[0]
            major, minor = cap.split(".")
            out["arch"] = f"sm_{int(major)}{int(minor)}"
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass
    else:
        errors.append("nvidia-smi: not on PATH")
    if shutil.which("nvcc"):
        try:
            m = re.search(r"release ([0-9.]+)", _run(["nvcc", "--version"]))
            tool["nvcc"] = m.group(1) if m else None
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(f"nvcc: {e}")
    for dist in ("torch", "triton", "pytorch-triton-rocm", "cupy-cuda12x", "atrex-bench"):
        try:
            tool[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    torch = tool.get("torch")
    if isinstance(torch, str) and "+cu" in torch:
        tool["runtime"] = torch.split("+cu", 1)[1]
    out["toolchain"] = tool
    return out, errors


class Environment:
    """Caches the host probe; merges the daemon's devices in on every request (they are cheap)."""

    def __init__(self, aliases: frozenset[str]) -> None:
        self.aliases = aliases
        self._host: tuple[dict[str, Any], list[str]] | None = None
        self._probed_at = ""
        self._lock = asyncio.Lock()

    async def view(
        self, status: dict[str, Any] | None, daemon_error: str, force: bool = False
    ) -> dict[str, Any]:
        async with self._lock:
            if self._host is None or force:
                self._host = await asyncio.to_thread(probe_host)
                self._probed_at = datetime.now(UTC).isoformat()
        host, errors = self._host
        errors = list(errors)
        devices: list[dict[str, Any]] = []
        policy = None
        if status is None:
            errors.append(f"krex daemon: {daemon_error or 'unreachable'}")
        else:
            policy = status.get("policy")
            devices = [
                {k: d.get(k) for k in ("index", "key", "vendor", "name", "memory_total_bytes", "numa_node")}
                for d in status.get("devices", [])
            ]
        gpus = [d for d in devices if d.get("vendor") not in ("cpu", None)]
        vendor = (
            host["vendor"]
            if host["vendor"] != "unknown"
            else (gpus[0]["vendor"] if gpus else ("cpu" if devices else "unknown"))
        )
        return {
            "gpu": "local",
            "aliases": sorted(self.aliases),
            "vendor": vendor,
            "gpu_model": host["gpu_model"] or (gpus[0]["name"] if gpus else None),
            "gpu_count": len(gpus),
            "devices": devices,
            "total_memory_mb": host["total_memory_mb"],
            "driver_version": host["driver_version"],
            "arch": host["arch"],
            "sm_count": None,
            "toolchain": host["toolchain"],
            "krex": {"policy": policy, "version": __version__, "auto_region": True},
            "source": "probe",
            "probed_at": self._probed_at,
            "probe_error": "; ".join(errors) or None,
            "checked_at": time.time(),
        }
