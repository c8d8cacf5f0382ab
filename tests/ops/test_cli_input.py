"""Values `krex` used to accept without a word, each now refused before anything runs: exit 2 and a
message naming the flag (or the KREX_* variable or file it came from) and the rule."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import subprocess
from pathlib import Path

import msgspec
import pytest

from krex_async import protocol as P
from krex_async.daemon.config import ConfigError, load_config_with_sources

from ..conftest import PY, ROOT, private_cgroup_root, py_env, remove_cgroup_tree, run_daemon

KREX = [PY, "-m", "krex_async"]


def krex(*args: str, env: dict[str, str] | None = None) -> tuple[int | str, str]:
    """(exit status, stderr); "still running" for a `krex serve` that took a bad value and served."""
    try:
        p = subprocess.run(
            [*KREX, *args], capture_output=True, text=True, env=env or py_env(), cwd=ROOT, timeout=20
        )
    except subprocess.TimeoutExpired as e:  # run() has killed it
        return "still running", (e.stderr or b"").decode(errors="replace")
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, p.stderr


def serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int | str, str]:
    sock = tmp_path / "s"
    out = krex(
        "serve",
        "--socket",
        str(sock),
        "--state-dir",
        str(tmp_path / "state"),
        "--probes",
        "off",
        *args,
        env=env,
    )
    assert out[0] == "still running" or not sock.exists(), "it bound its socket before refusing"
    return out


def test_serve_refuses_more_region_cores_than_krex_may_use(tmp_path: Path) -> None:
    """--region-cores is a count: the cpus of krex's affinity, less one that always stays for the
    other commands (cores.py would quietly reserve fewer)."""

    n = len(os.sched_getaffinity(0))
    for value in ("99999", str(n)):
        rc, err = serve(tmp_path, "--isolation", "signal", "--region-cores", value)
        assert rc == 2 and f"flag --region-cores: {value} region cores" in err, (rc, err)
        assert f"krex may use {n} cpus here" in err and f"give 0 to {n - 1}" in err, err
    env = py_env(KREX_REGION_CORES="99999")
    rc, err = serve(tmp_path, "--isolation", "signal", env=env)
    assert rc == 2 and "env KREX_REGION_CORES: 99999 region cores" in err, (rc, err)
    rc, err = serve(tmp_path, "--region-cores", "1,2")  # not a count at all: argparse says so
    assert rc == 2 and "argument --region-cores: invalid int value: '1,2'" in err, err
    from krex_async.daemon.startchecks import check_here  # new with this check

    for fine in (0, n - 1, -1):  # -1: the machine's default
        cfg, src = load_config_with_sources(None, {}, {"region_cores": fine, "isolation": "signal"})
        check_here(cfg, src)


def test_serve_refuses_a_given_cgroup_root_it_cannot_use(tmp_path: Path) -> None:
    """A root given on purpose is used or refused, never fallen back from to signals; the root krex
    finds itself may still fall back (isolation.choose_backend)."""

    rc, err = serve(tmp_path, "--cgroup-root", str(tmp_path / "nope"))
    assert rc == 2 and f"flag --cgroup-root: no directory {tmp_path / 'nope'}" in err, (rc, err)
    rc, err = serve(tmp_path, "--cgroup-root", str(tmp_path))
    assert rc == 2 and f"{tmp_path} is not a cgroup v2 directory" in err, (rc, err)
    rc, err = serve(tmp_path, env=py_env(KREX_CGROUP_ROOT=str(tmp_path / "nope")))
    assert rc == 2 and "env KREX_CGROUP_ROOT: no directory" in err, (rc, err)
    from krex_async.daemon.startchecks import check_here  # new with this check

    # --isolation signal uses no cgroup: the root (which `krex cleanup` may read) is not checked
    cfg, src = load_config_with_sources(None, {}, {"cgroup_root": "/nope", "isolation": "signal"})
    check_here(cfg, src)
    with pytest.raises(ConfigError, match="flag --cgroup-root: no directory /nope"):
        check_here(*load_config_with_sources(None, {}, {"cgroup_root": "/nope", "isolation": "cgroup"}))
    root = private_cgroup_root()
    if root is None:
        return  # a usable root needs root and cgroup v2; the refusals above hold anywhere
    try:
        check_here(*load_config_with_sources(None, {}, {"cgroup_root": root}))
    finally:
        remove_cgroup_tree(root)


def test_serve_refuses_probe_prefixes_the_probe_cannot_take(tmp_path: Path) -> None:
    """A relative prefix ended start-up in a traceback (probes on) or was kept unused (off)."""
    rc, err = serve(tmp_path, "--isolation", "signal", "--probe-prefixes", "/dev/nvidia,dri")
    assert rc == 2 and "flag --probe-prefixes: prefix 'dri': absolute path of 2..63 bytes" in err, err
    rc, err = serve(tmp_path, "--isolation", "signal", env=py_env(KREX_PROBE_PREFIXES=","))
    assert rc == 2 and "env KREX_PROBE_PREFIXES: at least one device path prefix" in err, err


def test_trace_takes_only_the_kinds_a_daemon_sends() -> None:
    rc, err = krex("trace", "--kind", "probe,bogus")
    assert rc == 2 and "argument --kind: unknown 'bogus' (known: command_start," in err, err
    assert all(k in err for k in P.TRACE_KINDS), err
    rc, err = krex("trace", "--kind", ",")
    assert rc == 2 and "argument --kind: none given" in err, err
    rc, err = krex("trace", "--pid", "0")
    assert rc == 2 and "argument --pid: 0 is not in 1..4194304" in err, err
    rc, err = krex("trace", "--kind", "probe,stray", "--kind", "freeze", "--socket", "/nonexistent/s")
    assert rc == 1 and "no krex daemon at /nonexistent/s" in err, err  # parsed, then no daemon


def test_trace_kinds_are_the_kinds_the_daemon_emits() -> None:
    """Every kind passed to `trace(...)` in the daemon is in TRACE_KINDS, and each of those is sent
    somewhere: the list --kind checks against cannot drift from the code."""
    sent: set[str] = set()
    for path in (ROOT / "krex_async").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "trace" and node.args:
                first = node.args[0]
                sent |= {
                    c.value
                    for c in ast.walk(first)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)
                }
    assert sent == set(P.TRACE_KINDS), sent ^ set(P.TRACE_KINDS)


def test_cleanup_refuses_a_root_that_is_no_directory(tmp_path: Path) -> None:
    rc, err = krex("cleanup", "--root", str(tmp_path / "nope"), "--socket", "/nonexistent/s")
    assert rc == 2 and f"argument --root: {tmp_path / 'nope'}: no such directory" in err, err
    (tmp_path / "f").write_text("")
    rc, err = krex("cleanup", "--root", str(tmp_path / "f"), "--socket", "/nonexistent/s")
    assert rc == 2 and "not a directory" in err, err
    # the daemon's cgroup root and state dir, given by hand: a typo would sweep or unlock nothing
    for flag in ("--cgroup-root", "--state-dir"):
        rc, err = krex(
            "cleanup", flag, str(tmp_path / "nope"), "--root", str(tmp_path), "--socket", "/nonexistent/s"
        )
        assert rc == 2 and f"argument {flag}: {tmp_path / 'nope'}: no such directory" in err, err
    rc, err = krex("cleanup", "--root", str(tmp_path), "--socket", "/nonexistent/s")  # neither given
    assert rc == 0, err


def test_run_without_a_command_is_a_usage_error() -> None:
    """125 means krex could not run a command (README); no command given is a usage error."""
    for args in (["run"], ["run", "--"], ["run", "--label", "x", "--"]):
        rc, err = krex(*args)
        assert rc == 2 and "usage: krex run" in err and "no command given" in err, (args, rc, err)


def test_run_label_and_device_longer_than_the_protocol_allows() -> None:
    for flag in ("--label", "--device"):
        rc, err = krex("run", flag, "x" * (P.MAX_NAME + 1), "--", "true")
        assert rc == 2 and f"argument {flag}: {P.MAX_NAME + 1} characters, more than the 256" in err, err
    # the limit is the protocol's, in characters: a 256-character label of 2-byte ones passes
    rc, err = krex("run", "--label", "é" * P.MAX_NAME, "--socket", "/nonexistent/s", "--", "true")
    assert rc == 125 and "no krex daemon" in err, err
    body = msgspec.msgpack.encode(P.Submit(id=1, argv=["true"], label="é" * P.MAX_NAME))
    assert P.decode_request(body).label == "é" * P.MAX_NAME
    with pytest.raises(msgspec.ValidationError):
        P.decode_request(msgspec.msgpack.encode(P.Submit(id=1, argv=["true"], label="x" * (P.MAX_NAME + 1))))


def test_run_timeout_of_zero_and_both_stdin_flags_are_usage_errors() -> None:
    """--timeout 0 killed the command as it started (GNU timeout reads 0 as no limit); --stdin with
    --no-stdin quietly meant --no-stdin."""
    rc, err = krex("run", "--timeout", "0", "--socket", "/nonexistent/s", "--", "true")
    assert rc == 2 and "argument --timeout: expected seconds > 0 (leave the flag out" in err, err
    rc, err = krex("run", "--stdin", "--no-stdin", "--socket", "/nonexistent/s", "--", "true")
    assert rc == 2 and "argument --no-stdin: not allowed with argument --stdin" in err, err


async def test_trace_device_and_status_json_stream_against_a_daemon() -> None:
    """trace --device must name a device of the node (it matched nothing); status --json --watch is
    JSON lines (it mixed a text header into the JSON), and a reader that leaves ends it quietly."""
    async with run_daemon("--isolation", "signal") as d:
        env = py_env(KREX_SOCKET=d.socket)
        rc, err = await asyncio.to_thread(krex, "trace", "--device", "cpu", "--device", "nvidia9", env=env)
        watch = subprocess.Popen(
            [*KREX, "status", "--json", "--watch", "0.1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        assert watch.stdout is not None and watch.stderr is not None
        lines = [await asyncio.to_thread(watch.stdout.readline) for _ in range(2)]
        watch.stdout.close()  # the reader leaves, as `| head -2` does
        code = await asyncio.to_thread(watch.wait, 30)
        stderr = watch.stderr.read().decode()
    assert rc == 2 and "--device nvidia9: no such device here (this node has: cpu)" in err, err
    assert [json.loads(x)["policy"] for x in lines] == ["region", "region"], lines
    assert code == 0 and "Traceback" not in stderr, stderr


def test_an_empty_report_or_export_path_is_refused_before_anything_runs() -> None:
    """An empty --report was found out only after the command ran; an empty --perfetto after the
    timeline was fetched."""
    rc, err = krex("run", "--report", "", "--socket", "/nonexistent/s", "--", "true")
    assert rc == 2 and "--report '': an empty path; the command was not run" in err, err
    rc, err = krex("export", "--perfetto", "", "--socket", "/nonexistent/s")
    assert rc == 2 and "--perfetto '': an empty path" in err, err
