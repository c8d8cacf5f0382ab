"""packaging/krex.service: passes `systemd-analyze verify` and says what krex needs of systemd."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from ..conftest import ROOT

UNIT = ROOT / "packaging" / "krex.service"


def directives() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def test_systemd_analyze_verify(tmp_path):
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    # verify checks that ExecStart= programs exist: point them at an executable that does.
    krex = tmp_path / "krex"
    krex.write_text(f"#!{sys.executable}\n")
    krex.chmod(0o755)
    unit = tmp_path / "krex.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/krex", str(krex)))
    p = subprocess.run(
        [exe, "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, SYSTEMD_LOG_LEVEL="notice"),
    )
    # verify returns 0 even for unknown keys and bad values; those show up as lines naming the unit.
    complaints = [ln for ln in (p.stdout + p.stderr).splitlines() if "krex.service" in ln]
    assert p.returncode == 0 and not complaints, p.stdout + p.stderr
    broken = tmp_path / "broken.service"
    broken.write_text(unit.read_text().replace("Delegate=yes", "Delegat=yes"))
    p = subprocess.run([exe, "verify", str(broken)], capture_output=True, text=True, timeout=60)
    assert "Unknown key" in p.stdout + p.stderr  # the check above can fail


def test_unit_says_what_krex_needs():
    d = directives()
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"]
    assert d["WatchdogSec"] and d["Delegate"] == ["yes"] and d["KillMode"] == ["mixed"]
    assert d["RuntimeDirectory"] == ["krex"]
    assert any("cleanup" in v for v in d["ExecStopPost"])
    assert not d["ExecStopPost"][0].startswith("-")  # a failed cleanup must show in the journal
    assert d["ExecStart"][0].split()[1] == "serve"
    for bad in (
        "ProtectControlGroups",
        "PrivateDevices",
        "DevicePolicy",
        "DeviceAllow",
        "ProtectKernelModules",
        "ProtectKernelTunables",
        "PrivateTmp",
        "ProtectClock",
        "MemoryDenyWriteExecute",
    ):
        assert bad not in d, f"{bad} breaks cgroup writes, BPF or GPU access for commands"
    assert d["ProtectSystem"] != ["strict"]
