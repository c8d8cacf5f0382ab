"""Commands run as the user who submitted them, with that user's groups and the environment given."""

from __future__ import annotations

import json

from .helpers import config_daemon
from .test_authz import call


async def test_commands_run_as_the_submitter_with_its_groups_and_the_environment_it_gave(users):
    alice = users["alice"]
    show = ["/bin/sh", "-c", 'id -u; id -g; id -G; echo "HOME=${HOME-unset} USER=${USER-unset}"']
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp/alice-home-given"}
    async with config_daemon(dir_mode=0o755, socket_group="krexg") as d:
        out = json.loads(await call(alice, d.socket, "run", *show, env=env))
        uid, gid, groups, names = out["stdout"].splitlines()
        assert int(uid) == alice.uid and int(gid) == alice.gid
        assert set(map(int, groups.split())) == {alice.gid, *alice.groups}, groups
        assert names == "HOME=/tmp/alice-home-given USER=unset"  # nothing of root's added
        async with await d.client() as root:
            res = await root.run(show, env=env)
        assert res.stdout.splitlines()[0] == b"0"  # root submitted: root it is
