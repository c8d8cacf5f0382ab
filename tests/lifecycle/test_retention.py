"""An ended command is forgotten (result, spool files, record) when its retention ends, also when
removing its isolation group failed."""

from __future__ import annotations

import asyncio
import os

import pytest

from krex_async import KrexError

from ..conftest import PY, private_cgroup_root, py_env, remove_cgroup_tree, run_daemon

# A command that makes a cgroup of its own inside its group (as a container runtime or systemd-run
# would): the daemon's rmdir of the group then fails (EBUSY) once the command has ended.
NESTS = """
import os
rel = [l for l in open('/proc/self/cgroup').read().splitlines() if l.startswith('0::')][0][3:]
os.mkdir(os.path.join({mount!r}, rel.lstrip('/'), 'nested'))
print('nested', flush=True)
"""


async def test_a_group_that_cannot_be_removed_does_not_keep_the_result_for_ever(tmp_path):
    root = private_cgroup_root()
    if root is None:
        pytest.skip("needs root and cgroup v2 (the cgroup backend)")
    mount = root.rsplit("/", 1)[0]
    try:
        async with run_daemon("--cgroup-root", root, "--retention", "1") as d:
            async with await d.client() as c:
                res = await c.run([PY, "-c", NESTS.format(mount=mount)], env=py_env())
                assert res.stdout == b"nested\n", res
                spools = [res.report.stdout_spool, res.report.stderr_spool]
                assert all(os.path.exists(p) for p in spools), spools
                cid = res.report.command
                deadline = asyncio.get_running_loop().time() + 8
                while True:
                    try:
                        await c.attach(cid)
                    except KrexError as e:
                        assert e.code == "unknown_command", e
                        break
                    assert asyncio.get_running_loop().time() < deadline, (
                        "the result outlived its retention of 1 s by 8 s"
                    )
                    await asyncio.sleep(0.2)
                assert not any(os.path.exists(p) for p in spools), spools
            assert "group_remove_failed" in d.logs()
    finally:
        remove_cgroup_tree(root)
