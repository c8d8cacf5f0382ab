"""Options naming what this node lacks (a device spec, a group, a metrics address) are refused before
anything starts: exit 2, one line naming the flag, KREX_* variable or file, and no reconcile, probe
or watchdog line before it (they exited 1 once all of that had started)."""

from __future__ import annotations

import argparse
import enum
import os
import typing
from pathlib import Path

import pytest

from krex_async.daemon.config import ConfigError, ServeConfig, choices, load_config_with_sources
from krex_async.ops import servecli

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


ENUMS = {
    "policy": "region, command, shared",
    "isolation": "auto, cgroup, signal",
    "freeze": "all, device-holders, auto",
    "hold": "auto, lock, freeze",
    "quiesce": "auto, all",
    "log_format": "auto, json, console",
    "log_level": "debug, info, warning, error",
    "probes": "auto, off, ioctl, launches, tracefs",
    "launch_scope": "outsiders, all",
    "admission": "auto, memory, off",
    "mem_commit": "auto, now, peak, none",
    "mem_guard": "peak, want",
    "mem_gate": "on, off",
}


def test_each_enum_option_is_spelled_once_for_the_flag_the_variable_and_the_file() -> None:
    """`krex serve`'s choices come from ServeConfig's types (they were typed twice, once as Literals
    and once as argparse lists): the flag takes exactly the values the variable and the file take."""
    sub = argparse.ArgumentParser().add_subparsers()
    servecli.add_parser(sub)
    flags = {a.dest: a for a in sub.choices["serve"]._actions}
    for field, said in ENUMS.items():
        assert choices(field) == said.split(", "), field
        assert flags[field].choices == choices(field), field
        with pytest.raises(SystemExit):
            sub.choices["serve"].parse_args(["--" + field.replace("_", "-"), "bogus"])
        ok = sub.choices["serve"].parse_args(["--" + field.replace("_", "-"), choices(field)[-1]])
        assert getattr(ok, field) == choices(field)[-1]
    assert {k for k, a in flags.items() if a.choices} == set(ENUMS)  # no flag has choices of its own


def test_a_bad_enum_value_from_a_variable_or_a_file_lists_the_choices(tmp_path: Path) -> None:
    """KREX_POLICY=bogus said only `Invalid enum value 'bogus'`; the flag (argparse) listed them."""
    hints = typing.get_type_hints(ServeConfig)
    enums = {
        k for k, t in hints.items() if typing.get_origin(t) is typing.Literal or isinstance(t, enum.EnumMeta)
    }
    assert enums == set(ENUMS), enums  # every enum option of serve is tried below
    for field, said in ENUMS.items():
        var = f"KREX_{field.upper()}"
        with pytest.raises(ConfigError) as e:
            load_config_with_sources(None, {var: "bogus"}, {})
        assert str(e.value) == f"{var}='bogus': Invalid enum value 'bogus' (choose from {said})"
    conf = tmp_path / "krex.toml"
    conf.write_text('hold = "bogus"\n')
    with pytest.raises(ConfigError, match=r"krex.toml:hold: .* \(choose from auto, lock, freeze\)"):
        load_config_with_sources(str(conf), {}, {})
    rc, err = serve(tmp_path, env=py_env(KREX_POLICY="bogus"))
    assert (
        rc == 2
        and "KREX_POLICY='bogus': Invalid enum value 'bogus' (choose from region, command, shared)" in err
    )
