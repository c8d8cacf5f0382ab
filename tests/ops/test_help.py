"""Help and the small consistencies a new user meets: bare `krex` is the help (exit 0), `run`'s
CMD is documented, `serve --help` is in sections, every --socket help names the socket in effect
(KREX_SOCKET), a time limit is refused with one message whatever the bad value, and the gateway
says when it stops."""

from __future__ import annotations

import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from ..conftest import PY, ROOT, py_env

KREX = [PY, "-m", "krex_async"]


def krex(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KREX, *args], capture_output=True, text=True, env=py_env(**env), cwd=ROOT, timeout=60
    )


def test_bare_krex_prints_the_help_and_exits_0() -> None:
    p = krex()
    assert p.returncode == 0, p.stderr  # it was 2: "the following arguments are required: verb"
    assert p.stdout.startswith("usage: krex") and p.stderr == "", p.stderr
    for verb in ("serve", "run", "status", "trace", "export", "gateway", "doctor", "cleanup"):
        assert re.search(rf"^\s+{verb}\s+\S", p.stdout, re.M), (verb, p.stdout)


def test_run_documents_its_command() -> None:
    p = krex("run", "--help")
    assert p.returncode == 0
    assert "usage: krex run [options] -- CMD [ARG ...]" in p.stdout, p.stdout
    assert re.search(r"^  -- CMD \.\.\.\s+the command to run", p.stdout, re.M), p.stdout
    assert "127 not found" in " ".join(p.stdout.split())


def test_serve_help_is_in_sections_and_lists_every_option_once() -> None:
    from krex_async.ops.servecli import GROUPS

    p = krex("serve", "--help")
    assert p.returncode == 0
    sections = re.findall(r"^([a-z][^\n:]*):$", p.stdout, re.M)
    assert sections == ["options", *(t for t, _ in GROUPS)], sections
    flags = re.findall(r"^  (--[a-z-]+)", p.stdout, re.M)
    assert len(flags) == len(set(flags)) and len(flags) > 45, flags
    own = p.stdout.split("options:")[1].split("\n\n")[0]  # what no section took: -h only
    assert re.findall(r"^  (-\S+)", own, re.M) == ["-h,"], own


def test_every_socket_help_names_the_socket_in_effect() -> None:
    sock = "/tmp/krexhelptest.sock"  # short, no hyphen: argparse wraps help text at either
    for verb in ("serve", "run", "status", "trace", "export", "cleanup"):
        p = krex(verb, "--help", KREX_SOCKET=sock)
        assert p.returncode == 0, p.stderr
        assert sock in " ".join(p.stdout.split()), (verb, p.stdout)


def test_a_bad_time_limit_reads_the_same_whatever_the_value() -> None:
    """`--timeout 0` said "> 0" and `--timeout -1` ">= 0": one validator, one message, exit 2."""
    for flag, verb in (("--timeout", ["run"]), ("--duration", ["trace"])):
        said = set()
        for bad in ("0", "-1", "abc", "inf"):
            argv = [*verb, f"{flag}={bad}", *(["--", "true"] if verb == ["run"] else [])]
            p = krex(*argv)
            assert p.returncode == 2, (argv, p.stderr)
            last = p.stderr.strip().splitlines()[-1]
            said.add(last.replace(repr(bad), "VALUE"))
        assert said == {
            f"krex {verb[0]}: error: argument {flag}: expected seconds > 0 "
            "(leave the flag out for no limit), got VALUE"
        }, said


def test_the_gateway_says_when_it_stops() -> None:
    pytest.importorskip("aiohttp")
    with tempfile.TemporaryDirectory(prefix="krexgw-", dir="/tmp") as d:
        Path(d).chmod(0o711)
        proc = subprocess.Popen(
            [*KREX, "gateway", "--listen", "127.0.0.1:0", "--state-dir", f"{d}/gw", "--socket", f"{d}/s"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=py_env(),
            cwd=ROOT,
        )
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline and not any("listening on" in x for x in lines):
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=30)[1]
    assert proc.returncode == 0, (lines, rest)
    url = next(x for x in lines if "listening on" in x).split("listening on ")[1].split()[0]
    assert f"krex gateway: stopped (was listening on {url})" in rest, rest
