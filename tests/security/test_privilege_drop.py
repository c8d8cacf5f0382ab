"""Nothing a user submits is used by a process that still holds the daemon's privileges: not the
environment (the dynamic loader honours LD_PRELOAD and LD_LIBRARY_PATH in root's processes too),
not the cwd, not argv[0]'s lookup. Real users over the real socket, a real gcc-built library."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

from ..conftest import private_cgroup_root, remove_cgroup_tree
from .helpers import User, config_daemon, python_as, user_env

RUN = r"""
import asyncio, json, sys
from krex_async import Client, KrexError

async def main(path, spec):
    spec = json.loads(spec)
    async with await Client.connect(path) as c:
        try:
            res = await c.run(spec["argv"], env=spec["env"], cwd=spec["cwd"])
        except KrexError as e:
            print(json.dumps({"refused": e.code, "error": e.message}))
            return
        r = res.report
        print(json.dumps({"state": r.state, "error": r.error, "exit_code": r.exit_code,
                          "stdout": res.stdout.decode(errors="replace")}))

asyncio.run(main(*sys.argv[1:]))
"""

RECORDER = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void record(void) {
    char exe[512] = {0};
    int fd = open(LOG, O_WRONLY | O_APPEND | O_CREAT, 0666);
    if (fd < 0) return;
    if (readlink("/proc/self/exe", exe, sizeof exe - 1) < 0) exe[0] = '?';
    dprintf(fd, "%s %d %s\n", TAG, (int)geteuid(), exe);
    close(fd);
}
"""


def submit_as(user: User, sock: str, argv: list[str], env: dict[str, str], cwd: str) -> dict:
    return json.loads(python_as(user, RUN, sock, json.dumps({"argv": argv, "env": env, "cwd": cwd})))


@pytest.fixture(params=["cgroup", "signal"])
def backend(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    if request.param == "signal":
        yield {"isolation": "signal"}
        return
    root = private_cgroup_root()
    if root is None or not shutil.which("setpriv"):
        pytest.skip("needs root, cgroup v2 and setpriv (the cgroup backend)")
    try:
        yield {"isolation": "cgroup", "cgroup_root": root}
    finally:
        remove_cgroup_tree(root)


@pytest.fixture
def world() -> Iterator[str]:
    """A directory every user can reach (the test's files live there)."""
    d = tempfile.mkdtemp(prefix="krexp-", dir="/tmp")
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _build(world: str) -> tuple[str, str, str]:
    """Two recording libraries (one preloaded by path, one by name through LD_LIBRARY_PATH) and
    the world-writable log they append `tag euid exe` to."""
    if not shutil.which("gcc"):
        pytest.skip("gcc is not installed: cannot build the recording library")
    log = os.path.join(world, "records.log")
    open(log, "w").close()
    os.chmod(log, 0o666)
    src = os.path.join(world, "rec.c")
    with open(src, "w") as f:
        f.write(RECORDER)
    libdir = os.path.join(world, "lib")
    os.mkdir(libdir)
    os.chmod(libdir, 0o755)
    pre, named = os.path.join(world, "librecpre.so"), os.path.join(libdir, "libreclp.so")
    for out, tag in ((pre, "preload"), (named, "libpath")):
        subprocess.run(
            ["gcc", "-shared", "-fPIC", "-o", out, src, f'-DLOG="{log}"', f'-DTAG="{tag}"'], check=True
        )
        os.chmod(out, 0o755)
    return f"{pre} libreclp.so", libdir, log


async def test_the_users_environment_reaches_no_privileged_process(users, backend, world):
    """A socket-group member preloads a library (by path and by name via LD_LIBRARY_PATH) that
    records its euid: the cgroup join wrapper and setpriv ran it as root before. No record says 0,
    the command itself loaded both, and it got its whole environment, byte for byte."""
    alice = users["alice"]
    preload, libdir, log = _build(world)
    env = {
        **user_env(),
        "LD_PRELOAD": preload,
        "LD_LIBRARY_PATH": libdir,
        "A-B.C": "x y 'z' \"q\" $HOME\nline 2",
        "EMPTY": "",
        "GLIBC_TUNABLES": "glibc.malloc.check=0",
    }
    async with config_daemon(dir_mode=0o755, socket_group="krexg", **backend) as d:
        out = await asyncio.to_thread(submit_as, alice, d.socket, ["/usr/bin/env", "-0"], env, world)
    assert out.get("state") == "exited" and out["exit_code"] == 0, out
    with open(log) as f:
        records = [line.split(" ", 2) for line in f.read().splitlines()]
    assert records, "the command did not load the libraries"
    assert not [r for r in records if r[1] == "0"], f"ran with euid 0: {records}"
    for tag in ("preload", "libpath"):
        assert [tag, str(alice.uid), "/usr/bin/env"] in records, records
    got = dict(e.split("=", 1) for e in out["stdout"].split("\0") if e)
    for k, v in env.items():
        if k != "PYTHONPATH":  # krex's runtime goes first on it
            assert got.get(k) == v, (k, got.get(k), v)
    assert got["PYTHONPATH"].endswith(env["PYTHONPATH"])
    assert got["KREX_COMMAND"] and got["KREX_TOKEN"]


async def test_cwd_and_argv0_are_entered_and_looked_up_as_the_user(users, backend, world):
    """A file readable by all under a directory the user cannot traverse stays unread, argv[0]
    there does not run, and the answer for a hidden path is the one for a missing path."""
    alice = users["alice"]
    hidden = os.path.join(world, "hidden")
    inner = os.path.join(hidden, "inner")
    os.makedirs(inner)
    os.chmod(hidden, 0o700)
    os.chmod(inner, 0o755)
    with open(os.path.join(inner, "secret.txt"), "w") as f:
        f.write("SECRET-7c1e\n")
    os.chmod(os.path.join(inner, "secret.txt"), 0o644)
    for d in (inner, world):
        prog = os.path.join(d, "prog")
        with open(prog, "w") as f:
            f.write("#!/bin/sh\necho RAN-$(id -u)\n")
        os.chmod(prog, 0o755)
    plain = os.path.join(world, "plain")  # no #!: run by /bin/sh, as execvp does
    with open(plain, "w") as f:
        f.write("echo PLAIN-$(id -u)\n")
    os.chmod(plain, 0o755)
    env = user_env()
    async with config_daemon(dir_mode=0o755, socket_group="krexg", **backend) as d:

        def run(argv: list[str], cwd: str) -> dict:
            return submit_as(alice, d.socket, argv, env, cwd)

        there, missing = await asyncio.gather(
            asyncio.to_thread(run, ["cat", "secret.txt"], inner),
            asyncio.to_thread(run, ["cat", "secret.txt"], os.path.join(hidden, "nothere")),
        )
        prog, noprog = await asyncio.gather(
            asyncio.to_thread(run, [os.path.join(inner, "prog")], world),
            asyncio.to_thread(run, [os.path.join(inner, "nothere")], world),
        )
        ok_rel = await asyncio.to_thread(run, ["./prog"], world)
        bare = await asyncio.to_thread(run, ["no-such-prog-krex"], world)
        no_shebang = await asyncio.to_thread(run, ["./plain"], world)
    assert "SECRET" not in there.get("stdout", ""), there
    assert there.get("state") == "failed", there
    assert there["error"].replace(inner, "P") == missing["error"].replace(
        os.path.join(hidden, "nothere"), "P"
    ), (there, missing)
    assert "RAN" not in prog.get("stdout", ""), prog
    assert prog.get("state") == "failed" and "not found" in prog["error"], prog
    assert prog["error"].replace(inner + "/prog", "P") == noprog["error"].replace(inner + "/nothere", "P"), (
        prog,
        noprog,
    )
    assert ok_rel.get("stdout", "").strip() == f"RAN-{alice.uid}", ok_rel
    assert bare.get("state") == "failed" and bare["exit_code"] == 127, bare
    assert no_shebang.get("stdout", "").strip() == f"PLAIN-{alice.uid}", no_shebang
