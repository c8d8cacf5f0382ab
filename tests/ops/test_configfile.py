"""Config layers (file < env < flags): merged values, and errors that name the source and the key."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest

from krex_async.daemon import config as configfile
from krex_async.daemon.config import (
    ConfigError,
    ServeConfig,
    load_config,
    load_config_with_sources,
    print_config,
)

from ..conftest import PY, ROOT, py_env


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "krex.toml"
    p.write_text(text)
    return str(p)


def test_layers_override_in_order(tmp_path):
    path = write(
        tmp_path, 'policy = "shared"\nregion-timeout = 7\nfreeze = "device-holders"\nmax_frame = 2048\n'
    )
    env = {
        "KREX_POLICY": "command",
        "KREX_REGION_TIMEOUT": "9.5",
        "KREX_COMMAND": "x-1",
        "KREX_SOCKET": "/tmp/k.sock",
        "KREX_LOG_LEVEL": "",
    }
    cfg, src = load_config_with_sources(path, env, {"region_timeout": 3.0, "devices": None})
    assert cfg.policy == "command"  # env over file
    assert cfg.region_timeout == 3.0  # flag over env over file
    assert cfg.freeze == "device-holders"  # file only
    assert cfg.max_frame == 2048
    assert cfg.socket == "/tmp/k.sock"  # KREX_SOCKET is the socket
    assert cfg.log_level == "info"  # an empty variable is unset
    assert cfg.devices == "auto"  # None flags are "not given"
    assert src == {
        "policy": "env KREX_POLICY",
        "region_timeout": "flag --region-timeout",
        "freeze": f"file {path}",
        "max_frame": f"file {path}",
        "socket": "env KREX_SOCKET",
    }


@pytest.mark.parametrize(
    "text, where",
    [
        ("region_timeout = -1\n", "krex.toml:region_timeout: Expected `float` > 0.0"),
        ('policy = "fastest"\n', "krex.toml:policy: Invalid enum value 'fastest'"),
        ('quiesce = "some"\n', "krex.toml:quiesce: Invalid enum value 'some'"),
        ('launch-scope = "everyone"\n', "krex.toml:launch_scope: Invalid enum value 'everyone'"),
        ('max-frame = "big"\n', "krex.toml:max_frame: Expected `int`, got `str`"),
        ("region_timout = 5\n", "krex.toml:region_timout: unknown key"),
        ("[serve]\npolicy = 'region'\n", "krex.toml:serve: is a table"),
        ("policy = \n", "krex.toml: not valid TOML"),
        ("region_timeout = 5\nregion-timeout = 6\n", "krex.toml:region-timeout: given twice"),
    ],
)
def test_file_errors_name_file_and_key(tmp_path, text, where):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text), {}, {})
    assert str(e.value).startswith(str(tmp_path) + "/"), e.value
    assert where in str(e.value)


def test_a_file_that_is_not_utf8_is_refused_naming_it(tmp_path):
    p = tmp_path / "krex.toml"
    p.write_bytes(b'policy = "region\xff"\n')
    with pytest.raises(ConfigError, match=r"krex.toml: not UTF-8 \(TOML is\)"):
        load_config(str(p), {}, {})


def test_strict_types_in_file(tmp_path):
    # TOML has types: a string where a number belongs is an error in the file (it is not in env).
    with pytest.raises(ConfigError, match=r"krex.toml:region_timeout: Expected `float`, got `str`"):
        load_config(write(tmp_path, 'region_timeout = "5"\n'), {}, {})


@pytest.mark.parametrize(
    "env, msg",
    [
        ({"KREX_REGION_TIMEOUT": "soon"}, "KREX_REGION_TIMEOUT='soon': Expected `float`, got `str`"),
        (
            {"KREX_POLICY": "fast"},
            "KREX_POLICY='fast': Invalid enum value 'fast' (choose from region, command, shared)",
        ),
        ({"KREX_QUIESCE": "none"}, "KREX_QUIESCE='none': Invalid enum value 'none' (choose from auto, all)"),
        (
            {"KREX_LAUNCH_SCOPE": "mine"},
            "KREX_LAUNCH_SCOPE='mine': Invalid enum value 'mine' (choose from outsiders, all)",
        ),
        ({"KREX_MAX_FRAME": "12"}, "KREX_MAX_FRAME='12': Expected `int` >= 1024"),
        ({"KREX_REGION_TIMEOUT": "\udcff"}, "KREX_REGION_TIMEOUT='\\udcff': not UTF-8"),
    ],
)
def test_env_errors_name_the_variable(env, msg):
    with pytest.raises(ConfigError) as e:
        load_config(None, env, {})
    assert str(e.value) == msg


@pytest.mark.parametrize(
    "cli, msg",
    [
        ({"region_timeout": 0.0}, "--region-timeout: Expected `float` > 0.0"),
        ({"region_cores": -5}, "--region-cores: Expected `int` >= -1"),
        ({"bogus_flag": 1}, "--bogus-flag: not a serve option"),
        ({"launch_scope": "none"}, "--launch-scope: Invalid enum value 'none' (choose from outsiders, all)"),
    ],
)
def test_cli_errors_name_the_flag(cli, msg):
    with pytest.raises(ConfigError) as e:
        load_config(None, {}, cli)
    assert str(e.value) == msg


def test_missing_files(tmp_path, monkeypatch):
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="nope.toml: config file not found"):
        load_config(missing, {}, {})
    monkeypatch.setattr(configfile, "DEFAULT_PATH", missing)
    assert load_config(None, {}, {}) == ServeConfig()  # the default file is optional


def test_print_config_round_trips(tmp_path):
    path = write(tmp_path, 'policy = "shared"\nsocket = "/tmp/a \\"b\\".sock"\n')
    cfg, src = load_config_with_sources(path, {"KREX_DRAIN_TIMEOUT": "0.5"}, {"region_cores": 1})
    text = print_config(cfg, src)
    assert f"# file {path}" in text and "# env KREX_DRAIN_TIMEOUT" in text
    assert "# flag --region-cores" in text and "# default" in text
    again = write(tmp_path, text)
    assert tomllib.loads(text)["drain_timeout"] == 0.5
    assert load_config(again, {}, {}) == cfg


def _serve_help() -> str:
    return subprocess.run(
        [PY, "-m", "krex_async", "serve", "--help"],
        capture_output=True,
        text=True,
        env=py_env(),
        cwd=ROOT,
        timeout=30,
    ).stdout


def test_serve_print_config_uses_all_layers(tmp_path):
    if "--config" not in _serve_help():
        pytest.skip("wired by lead: `krex serve --config` is not accepted yet")
    path = write(tmp_path, 'policy = "shared"\nregion_timeout = 7.0\n')
    p = subprocess.run(
        [PY, "-m", "krex_async", "serve", "--config", path, "--region-timeout", "3", "--print-config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
        env=py_env(KREX_FREEZE="device-holders"),
    )
    assert p.returncode == 0, p.stderr
    out = tomllib.loads(p.stdout)
    assert (out["policy"], out["region_timeout"], out["freeze"]) == ("shared", 3.0, "device-holders")
    bad = subprocess.run(
        [PY, "-m", "krex_async", "serve", "--config", path, "--print-config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
        env=py_env(KREX_REGION_TIMEOUT="later"),
    )
    assert bad.returncode == 2 and "KREX_REGION_TIMEOUT='later'" in bad.stderr


def test_launch_scope_layers_and_print_config(tmp_path):
    """--launch-scope (default outsiders) from each layer, and shown by --print-config."""
    assert ServeConfig().launch_scope == "outsiders"
    path = write(tmp_path, 'launch_scope = "all"\n')
    assert load_config(path, {}, {}).launch_scope == "all"
    cfg, src = load_config_with_sources(path, {"KREX_LAUNCH_SCOPE": "outsiders"}, {})
    assert cfg.launch_scope == "outsiders" and src["launch_scope"] == "env KREX_LAUNCH_SCOPE"
    cfg, src = load_config_with_sources(path, {"KREX_LAUNCH_SCOPE": "outsiders"}, {"launch_scope": "all"})
    assert cfg.launch_scope == "all" and src["launch_scope"] == "flag --launch-scope"
    p = subprocess.run(
        [PY, "-m", "krex_async", "serve", "--launch-scope", "all", "--print-config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
        env=py_env(),
    )
    assert p.returncode == 0, p.stderr
    assert tomllib.loads(p.stdout)["launch_scope"] == "all"
    assert "# flag --launch-scope" in p.stdout
    p = subprocess.run(
        [PY, "-m", "krex_async", "serve", "--print-config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
        env=py_env(KREX_LAUNCH_SCOPE="some"),
    )
    assert p.returncode == 2 and "KREX_LAUNCH_SCOPE='some': Invalid enum value 'some'" in p.stderr


def test_a_drain_window_not_shorter_than_the_drain_timeout_is_refused():
    """Every drain check would end in `timeout`: said before the daemon starts, naming where each
    of the two came from. The rule holds for the merged options, so a drain timeout below the
    default window can be set in one layer and the window in another."""
    with pytest.raises(
        ConfigError,
        match=r"env KREX_DRAIN_TIMEOUT and flag --drain-window: "
        r"drain_timeout \(0.1 s\) is not longer than drain_window \(0.5 s\)",
    ):
        load_config(None, {"KREX_DRAIN_TIMEOUT": "0.1"}, {"drain_window": 0.5})
    with pytest.raises(ConfigError, match=r"flag --drain-timeout: .* not longer than drain_window"):
        load_config(None, {}, {"drain_timeout": 0.02})  # equal to the default window
    env = {"KREX_DRAIN_TIMEOUT": "0.01", "KREX_DRAIN_WINDOW": "0.005"}
    assert load_config(None, env, {}).drain_timeout == 0.01
    split = load_config(None, {"KREX_DRAIN_WINDOW": "0.005"}, {"drain_timeout": 0.01})
    assert (split.drain_window, split.drain_timeout) == (0.005, 0.01)
    assert load_config(None, {}, {"drain_window": 0.05}).drain_window == 0.05


def test_example_file_loads_and_documents_every_option():
    example = ROOT / "packaging" / "krex.toml.example"
    assert load_config(str(example), {}, {}) == ServeConfig()  # the example states the defaults
    text = example.read_text()
    for name in ServeConfig.__struct_fields__:
        assert f"\n{name} =" in text or f"\n# {name} =" in text, f"{name} not in the example"


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--settle-fraction", "2", "--settle-fraction: Expected `float` <= 1.0"),
        ("--settle-fraction", "0", "--settle-fraction: Expected `float` > 0.0"),
        ("--settle-ms", "-1", "--settle-ms: Expected `float` >= 0.0"),
        ("--max-connections", "0", "--max-connections: Expected `int` >= 1"),
        ("--max-commands", "0", "--max-commands: Expected `int` >= 1"),
        ("--max-buffered-total", "10", "--max-buffered-total: Expected `int` >= 65536"),
        ("--spool-limit", "-1", "--spool-limit: Expected `int` >= 0"),
        ("--max-connections-per-user", "0", "--max-connections-per-user: Expected `int` >= 1"),
        ("--max-commands-per-user", "0", "--max-commands-per-user: Expected `int` >= 1"),
        ("--max-inbound-bytes", "10", "--max-inbound-bytes: Expected `int` >= 1048576"),
        ("--lock-wait", "-1", "--lock-wait: Expected `float` >= 0.0"),
        ("--lock-wait", "11", "--lock-wait: Expected `float` <= 10.0"),
        ("--exit-wait", "-2", "--exit-wait: Expected `float` >= -1.0"),
        ("--exit-kernel-wait", "-1", "--exit-kernel-wait: Expected `float` >= 0.0"),
        ("--exit-kernel-wait", "11", "--exit-kernel-wait: Expected `float` <= 10.0"),
        ("--drain-window", "0", "--drain-window: Expected `float` >= 0.001"),
        ("--drain-timeout", "0", "--drain-timeout: Expected `float` > 0.0"),
        ("--drain-timeout", "0.01", "flag --drain-timeout: drain_timeout (0.01 s) is not longer"),
        ("--launch-scope", "everyone", "argument --launch-scope: invalid choice: 'everyone'"),
        ("--pool-keep-s", "-1", "--pool-keep-s: Expected `float` >= 0.0"),
        ("--pool-keep-s", "abc", "argument --pool-keep-s: invalid float value: 'abc'"),
    ],
)
def test_serve_flags_reject_bad_values_before_serving(tmp_path, flag, value, message):
    """A bad value stops `krex serve` with the flag and the rule named, before it binds anything."""
    sock = tmp_path / "s"
    p = subprocess.run(
        [PY, "-m", "krex_async", "serve", "--socket", str(sock), flag, value],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
        env=py_env(),
    )
    assert p.returncode != 0 and message in p.stderr, p.stderr
    assert not sock.exists()
