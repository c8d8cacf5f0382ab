"""Options naming what this node lacks (a device spec, a group, a metrics address) are refused before
anything starts: exit 2, one line naming the flag, KREX_* variable or file, and no reconcile, probe
or watchdog line before it (they exited 1 once all of that had started)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ..conftest import py_env, run_daemon
from .test_cli_input import serve

N = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    "args,said",
    [
        (("--devices", "gpu:3"), "flag --devices: bad device spec 'gpu:3': expected auto, none, cpu:N"),
        (("--devices", "cpu:0"), "flag --devices: bad device spec 'cpu:0': N must be 1 to 1024"),
        (("--devices", f"cpu:{N + 1}"), f"flag --devices: cpu:{N + 1}: {N + 1} logical cpu devices, but"),
        (("--devices", "cpu:999"), f"krex may use {N} cpus here: give cpu:1 to cpu:{N}"),
        (("--socket-group", "nosuchkrexgroup"), "flag --socket-group: 'nosuchkrexgroup': no such group"),
        (("--admin-group", "nosuchkrexgroup"), "flag --admin-group: 'nosuchkrexgroup': no such group"),
        (("--metrics", "bogus"), "flag --metrics: 'bogus': expected HOST:PORT, e.g. 127.0.0.1:9464"),
    ],
)
def test_serve_refuses_what_it_cannot_serve_before_starting(tmp_path: Path, args, said) -> None:
    rc, err = serve(tmp_path, "--isolation", "signal", "--log-format", "json", *args)
    assert rc == 2 and said in err, (rc, err)
    assert err.count("\n") == 1 and err.startswith("krex serve: "), err  # nothing had started


def test_the_source_is_named_for_a_variable_and_a_file(tmp_path: Path) -> None:
    rc, err = serve(tmp_path, "--isolation", "signal", env=py_env(KREX_DEVICES="cpu:999"))
    assert rc == 2 and "env KREX_DEVICES: cpu:999: 999 logical cpu devices" in err, (rc, err)
    conf = tmp_path / "krex.toml"
    conf.write_text('metrics = "nohost"\nsocket_group = "nosuchkrexgroup"\n')
    rc, err = serve(tmp_path, "--isolation", "signal", "--config", str(conf))
    assert rc == 2 and f"file {conf}: 'nosuchkrexgroup': no such group" in err, (rc, err)


async def test_a_cpu_of_its_own_for_each_device_is_served() -> None:
    """cpu:N up to the cpus krex may use still serves, each device on cpus of its own."""
    async with run_daemon("--isolation", "signal", "--devices", f"cpu:{N}") as d:
        async with await d.client() as c:
            devs = (await c.status())["devices"]
    assert [x["key"] for x in devs] == [f"cpu{i}" for i in range(N)]
    assert sum(len(x["cpus"]) for x in devs) == N
