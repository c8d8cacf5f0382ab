"""`krex doctor`'s cgroup checks (the package, kernel, BPF and GPU checks are in doctor.py and
doctor_kernel.py): layout, the subtree the daemon would use, a real freeze and thaw of a test process
there, the cpuset, and what `--isolation auto` would pick.

The test cgroups are made under the subtree the daemon would use, named `krex-doctor-<pid>`, and
removed in `finally` (their test process killed first).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import select
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator

from krex_async.isolation.cgroupfs import CgroupFileError, CgroupFS
from krex_async.ops import cleanup as cg
from krex_async.ops.doctor_check import FAIL, OK, WARN, Check

SERVICE_CGROUP = "/system.slice/krex.service"  # where packaging/krex.service runs the daemon


def _read(cgroup: str, name: str) -> str | None:
    try:
        return CgroupFS(cgroup).read("", name).strip()
    except CgroupFileError:
        return None


def v2_subtree(cgroup_root: str = "") -> tuple[str | None, str]:
    """The v2 directory the daemon would create command cgroups under, and how it was found: the
    configured root, else the krex.service cgroup when the unit runs, else this process's own."""
    if cgroup_root:
        return cgroup_root, "configured cgroup_root"
    m = cg.v2_mount()
    if m is None:
        return None, "no cgroup v2 mount"
    unit = os.path.join(m, SERVICE_CGROUP.lstrip("/"))
    if os.path.isdir(unit):  # the running service's delegated cgroup, not this shell's session
        return unit, "the krex.service cgroup (Delegate=yes)"
    own = cg.own_cgroup("") or "/"
    if own == "/" and cg.layout() == "hybrid":
        return m, f"the v2 mount of a hybrid host ({m})"
    return os.path.normpath(os.path.join(m, own.lstrip("/"))), f"this process's own cgroup ({own})"


@contextlib.contextmanager
def _test_cgroup(parent: str) -> Iterator[str]:
    """A fresh child cgroup (v2, or a v1 hierarchy's), removed afterwards (its processes killed
    first)."""
    fs, rel = CgroupFS(parent), f"krex-doctor-{os.getpid()}"
    fs.mkdir(rel)
    try:
        yield fs.path(rel)
    finally:
        try:
            pids = fs.procs(rel)
        except CgroupFileError:
            pids = []
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if fs.exists(rel, "cgroup.freeze"):
            with contextlib.suppress(CgroupFileError):
                fs.write(rel, "cgroup.freeze", "0")
        deadline = time.monotonic() + 2
        while True:
            try:
                fs.rmdir(rel)
                break
            except CgroupFileError:  # EBUSY until the killed processes are reaped
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)


def _wait_frozen(events: str, want: str, timeout: float) -> bool:
    """Wait (POLLPRI on cgroup.events, bounded) until it says `frozen <want>`."""
    fd = os.open(events, os.O_RDONLY)
    try:
        p = select.poll()
        p.register(fd, select.POLLPRI | select.POLLERR)
        deadline = time.monotonic() + timeout
        while True:
            data = os.pread(fd, 4096, 0).decode()
            if f"frozen {want}" in data.splitlines():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            p.poll(left * 1000)
    finally:
        os.close(fd)


def check_cgroups(cgroup_root: str = "") -> list[Check]:
    """Layout, delegated subtree, writable, freezer (a real freeze of a test process), cpuset."""
    lay = cg.layout()
    m2 = cg.v2_mount()
    fixes = {
        "none": "mount cgroup2: `mount -t cgroup2 none /sys/fs/cgroup` (or boot with "
        "systemd.unified_cgroup_hierarchy=1)",
        "v1": "boot with systemd.unified_cgroup_hierarchy=1 (or mount cgroup2 beside v1)",
    }
    out = [
        Check(
            "cgroup layout",
            OK if lay in ("v2", "hybrid") else FAIL,
            {
                "v2": f"pure cgroup v2 at {m2}",
                "hybrid": f"hybrid: v2 at {m2}, v1 controllers beside it",
                "v1": "cgroup v1 only",
                "none": "no cgroup filesystem",
            }[lay],
            fixes.get(lay, ""),
            {"layout": lay, "v2_mount": m2},
        )
    ]
    sub, how = v2_subtree(cgroup_root)
    freezer_ok = cpuset_ok = False
    if sub is None or not os.path.isdir(sub):
        out.append(
            Check(
                "cgroup subtree",
                FAIL,
                f"no v2 subtree to use ({how}: {sub})",
                "run the daemon under systemd with Delegate=yes (packaging/krex.service) "
                "or pass --cgroup-root DIR",
            )
        )
        out.append(Check("cgroup freezer", FAIL, "no subtree to test in", ""))
    else:
        out.append(Check("cgroup subtree", OK, f"{sub} ({how})", data={"path": sub}))
        try:
            with _test_cgroup(sub) as child:
                out.append(Check("cgroup writable", OK, f"created and removed {child}"))
                out.append(_check_freeze(child))
                freezer_ok = out[-1].verdict == OK
        except (OSError, CgroupFileError) as e:
            out.append(
                Check(
                    "cgroup writable",
                    FAIL,
                    f"cannot create a child of {sub}: {e}",
                    "run as root, or give the daemon a delegated subtree (systemd "
                    "Delegate=yes) and pass it with --cgroup-root",
                )
            )
            out.append(Check("cgroup freezer", FAIL, "not tested: the subtree is not writable"))
    cs = _check_cpuset(sub)
    cpuset_ok = cs.verdict == OK
    out.append(cs)
    out[0].data["full_isolation"] = freezer_ok and cpuset_ok
    return out


def _check_freeze(child: str) -> Check:
    fs = CgroupFS(child)
    fz = fs.path("", "cgroup.freeze")
    if not fs.exists("", "cgroup.freeze"):
        return Check(
            "cgroup freezer",
            FAIL,
            f"{fz} does not exist (kernel older than 5.2?)",
            "a kernel with the cgroup v2 freezer (5.2+)",
        )
    proc = subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL)
    try:
        fs.write("", "cgroup.procs", str(proc.pid))
        times = []
        for _ in range(2):  # the first freeze after a move into the cgroup is slower (~10-20 ms)
            t0 = time.perf_counter()
            fs.write("", "cgroup.freeze", "1")
            frozen = _wait_frozen(os.path.join(child, "cgroup.events"), "1", 1.0)
            times.append(time.perf_counter() - t0)
            fs.write("", "cgroup.freeze", "0")
            thawed = _wait_frozen(os.path.join(child, "cgroup.events"), "0", 1.0)
            if not (frozen and thawed):
                break
    except (OSError, CgroupFileError) as e:
        return Check(
            "cgroup freezer",
            FAIL,
            f"freezing a test process failed: {e}",
            "the daemon needs write access to cgroup.procs and cgroup.freeze there",
        )
    finally:
        proc.kill()
        proc.wait()
        fs.release()
    if not (frozen and thawed):
        return Check(
            "cgroup freezer",
            FAIL,
            f"froze={frozen} thawed={thawed} within 1 s",
            "check `cat cgroup.events` of a frozen cgroup; report the kernel version",
        )
    return Check(
        "cgroup freezer",
        OK,
        f"froze and thawed a test process: {times[1] * 1e3:.2f} ms "
        f"(first freeze after moving it in: {times[0] * 1e3:.2f} ms)",
        data={"freeze_s": times[1], "first_freeze_s": times[0]},
    )


def _check_cpuset(sub: str | None) -> Check:
    if sub is not None:
        ctrls = (_read(sub, "cgroup.controllers") or "").split()
        enabled = (_read(sub, "cgroup.subtree_control") or "").split()
        if "cpuset" in ctrls:
            state = (
                "enabled for children"
                if "cpuset" in enabled
                else "available (the daemon enables it in subtree_control)"
            )
            return Check(
                "cpuset",
                OK,
                f"cgroup v2 cpuset in {sub}: {state}",
                data={"mode": "v2", "enabled": "cpuset" in enabled},
            )
    m1 = cg.v1_mount("cpuset")
    if m1 is not None:
        own = cg.own_cgroup("cpuset") or "/"
        base = os.path.normpath(os.path.join(m1, own.lstrip("/")))
        try:
            with _test_cgroup(base):
                pass
        except CgroupFileError as e:
            return Check("cpuset", FAIL, f"v1 cpuset at {base} is not writable: {e}", "run as root")
        return Check(
            "cpuset",
            OK,
            f"v1 cpuset hierarchy at {base} (hybrid; cores via v1, freezing via v2)",
            data={"mode": "v1", "path": base},
        )
    return Check(
        "cpuset",
        FAIL,
        "no cpuset: neither in the v2 subtree's cgroup.controllers nor a v1 cpuset hierarchy",
        "enable it: `echo +cpuset > <parent>/cgroup.subtree_control` up to the daemon's "
        "subtree (systemd: Delegate=yes, or Delegate=cpuset cpu memory pids)",
    )


def check_backend(cgroup_root: str = "") -> Check:
    """What `--isolation auto` would pick, by asking the daemon's own chooser (which refuses a
    root given on purpose that it cannot use, as `krex serve` does)."""
    try:
        from krex_async.isolation import RootUnusable, choose_backend

        with tempfile.TemporaryDirectory(prefix="krex-doctor-") as state:
            b = choose_backend("auto", cgroup_root=cgroup_root, state_dir=state)
            name, reason = b.name, b.reason
            # its instance directory and owner lock: none left per doctor run; on a thread of its
            # own, for run_checks called from a running loop
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pool.submit(asyncio.run, b.close()).result()
    except RootUnusable as e:
        return Check(
            "isolation backend",
            FAIL,
            f"krex serve refuses --cgroup-root {e.root} (a root given on purpose is never fallen "
            f"back from): {e.why}",
            RootUnusable.HINT,
            {"backend": None},
        )
    except (ImportError, SystemExit, Exception) as e:
        return Check(
            "isolation backend",
            FAIL,
            f"choosing the backend failed: {e}",
            "report this with `krex doctor --json`",
        )
    return Check(
        "isolation backend",
        OK if name == "cgroup" else WARN,
        f"--isolation auto picks {name}: {reason}"
        + (
            ""
            if name == "cgroup"
            else "; it finds a command's processes by its tree, session and environment (KREX_COMMAND): "
            "one that clears its environment and detaches (setsid) is neither held by regions nor killed"
        ),
        "" if name == "cgroup" else "the cgroup backend gives full isolation: see the cgroup checks above",
        {"backend": name},
    )
