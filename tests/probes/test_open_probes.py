"""open_probes: which backend runs and why, in one line."""

from __future__ import annotations

import pytest

from krex_async.probes import CombinedProbe, bcc_works, open_probes, tracefs_works
from krex_async.probes.bpf_ioctl import IoctlProbe
from krex_async.probes.tracefs import TracefsProbe


def test_off_and_bad_mode() -> None:
    assert open_probes("off") == (None, "probes: off (requested)")
    with pytest.raises(ValueError):
        open_probes("sometimes")
    with pytest.raises(ValueError):
        open_probes("auto", prefixes=["no-slash"])


def test_auto_prefers_bcc_then_tracefs() -> None:
    backend, reason = open_probes("auto", prefixes=["/dev/krex-test"])
    bcc_ok, _ = bcc_works()
    tr_ok, _ = tracefs_works()
    assert "\n" not in reason
    if bcc_ok:
        assert isinstance(backend, IoctlProbe) and "bcc ioctl on /dev/krex-test" in reason
    elif tr_ok:
        assert isinstance(backend, TracefsProbe) and "bcc unavailable" in reason
    else:
        assert backend is None and "none" in reason


def test_explicit_modes() -> None:
    backend, reason = open_probes("tracefs")
    ok, why = tracefs_works()
    assert isinstance(backend, TracefsProbe) if ok else backend is None
    backend, reason = open_probes("launches", launch_libs=["/nonexistent/libcuda.so.1"])
    if bcc_works()[0]:
        assert isinstance(backend, CombinedProbe) and "launch uprobes" in reason
    else:
        assert backend is None and "bcc unavailable" in reason


async def test_combined_keeps_ioctl_when_launches_cannot_run() -> None:
    import asyncio

    if not bcc_works()[0]:
        pytest.skip("bcc unavailable")
    backend, _ = open_probes(
        "launches", prefixes=["/dev/krex-test"], launch_libs=["/nonexistent/libcuda.so.1"]
    )
    assert isinstance(backend, CombinedProbe)
    backend.parts[1].search = False  # type: ignore[attr-defined]  # this host's libs are not the point
    backend.start(asyncio.get_running_loop(), lambda b: None)
    try:
        assert backend.name == "bcc-ioctl" and "no libcuda" in backend.failed["bcc-launches"]
        assert backend.lost() == 0 and backend.counts() == {}
    finally:
        backend.stop()
