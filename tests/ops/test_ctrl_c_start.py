"""Ctrl-C at any moment of a `krex` verb's start: SIGINT sent 0-150 ms after spawning the real CLI
(the console script, as a user runs it), over the ~70 ms its modules import. It used to print a
KeyboardInterrupt traceback from whichever import it landed in; now it ends quietly: 130, or 0 for
`krex serve` (as a later Ctrl-C of it), and is never lost.

Some outcomes come outside krex's code and are beyond it (linux/interrupt.py): a SIGINT before
the interpreter installs its handler, or after the verb returned, kills it (-SIGINT, silent; a
shell says 130), and one during the interpreter's own start (site, .pth files, the import statement
of the console script) gets Python's traceback with no krex frame in it. Any traceback through
krex's code fails the test."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from ..conftest import PY, ROOT, py_env

SCRIPT = Path(sys.executable).parent / "krex"
KREX = [str(SCRIPT)] if SCRIPT.exists() else [PY, "-m", "krex_async"]
KREX_FRAME = re.compile(r'File "[^"]*/krex_async/')


def interrupted(argv: list[str], delay: float, krex: list[str] = KREX) -> tuple[int, str]:
    p = subprocess.Popen(
        [*krex, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=py_env(), cwd=ROOT
    )
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        pytest.fail(f"krex {argv[0]}: a Ctrl-C {delay * 1000:.0f} ms after its start was lost")
    return p.returncode, (out + err).decode(errors="replace")


def outcome(rc: int, text: str, done: set[int]) -> str:
    """'start' (quiet 130 / serve's 0), 'done' (the verb had ended: a status of `done`), or
    'before krex' (see the module doc); fails on anything else."""
    if "Traceback" in text or "Fatal Python error" in text:
        assert not KREX_FRAME.search(text), text
        return "before krex"  # site's fatal error, or one the interpreter printed and went on from
    if rc == -signal.SIGINT:  # the interpreter's default, before krex's first line or after its last
        return "before krex" if text == "" else "done"
    if rc in done:
        return "done"
    assert rc == 130, (rc, text)
    return "start"


VERBS = {
    # verb: (argv, exit statuses of a run the Ctrl-C did not stop, the quiet status of one it did)
    "status": (["status", "--socket", "/nonexistent/krex.sock"], {1, 0}),  # 0: Ctrl-C ends a watch
    "run": (["run", "--socket", "/nonexistent/krex.sock", "--", "true"], {125}),
}


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_ctrl_c_while_a_verb_starts_ends_it_quietly_with_130(verb: str) -> None:
    argv, done = VERBS[verb]
    seen: Counter[str] = Counter()
    for ms in range(0, 151, 5):
        seen[outcome(*interrupted(argv, ms / 1000), done)] += 1
    assert seen["start"] >= 3, f"too few Ctrl-Cs landed in the start to show anything: {seen}"


def test_ctrl_c_while_krex_serve_starts_ends_it_as_a_later_one(tmp_path: Path) -> None:
    seen: Counter[str] = Counter()
    for ms in range(0, 151, 5):
        d = tmp_path / str(ms)
        d.mkdir()
        argv = ["serve", "--socket", str(d / "s"), "--state-dir", str(d / "st")]
        rc, text = interrupted(argv + ["--isolation", "signal", "--probes", "off"], ms / 1000)
        kind = outcome(130 if rc == 0 else rc, text, set())  # serve stops with 0, as later
        assert rc != 130, text
        seen[kind] += 1
        assert not os.path.exists(d / "s"), text
    assert seen["start"] >= 10, seen


def test_interpreter_options_grouped_with_m_start_krex_and_its_users(tmp_path: Path) -> None:
    """`python -Bm krex_async` (-Im, -um: any short options grouped with -m) raised StopIteration
    in the package's __init__, which looked for a word starting "-m"; so did `python -um` of any
    krex_async module, and a user's `python -Bm tool` whose package imports krex_async. Now the
    CLI started so holds a Ctrl-C as `-m krex_async` does, and the others leave SIGINT alone."""
    for argv in (["-Bm", "krex_async", "--version"], ["-um", "krex_async.isolation.watchdog", "--help"]):
        r = subprocess.run([PY, *argv], capture_output=True, text=True, env=py_env(), cwd=ROOT, timeout=60)
        assert r.returncode == 0, r.stderr
    tool = tmp_path / "tool"
    tool.mkdir()
    (tool / "__init__.py").write_text("import krex_async\n")
    (tool / "__main__.py").write_text(
        "import signal\nprint(sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))\n"
    )
    env = py_env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    r = subprocess.run([PY, "-Bm", "tool"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert (r.returncode, r.stdout) == (0, "[]\n"), r.stderr
    argv, done = VERBS["status"]
    seen: Counter[str] = Counter()
    for ms in range(0, 151, 10):
        seen[outcome(*interrupted(argv, ms / 1000, [PY, "-W", "ignore", "-Bm", "krex_async"]), done)] += 1
    assert seen["start"] >= 3, f"too few Ctrl-Cs landed in the start to show anything: {seen}"


EARLY = {
    # verb: (argv, exit statuses of a run the Ctrl-C did not stop)
    "run": (["run", "--socket", "/nonexistent/krex.sock", "--", "true"], {125}),
    "doctor": (["doctor", "--json"], {0, 1}),
    "trace": (["trace", "--socket", "/nonexistent/krex.sock"], {1}),
}


@pytest.mark.parametrize("verb", sorted(EARLY))
def test_the_krex_command_ends_quietly_on_a_ctrl_c_in_its_first_50_ms(verb: str) -> None:
    """The installed `krex` (packaging/bin/krex) blocks SIGINT before the interpreter's site
    import: a Ctrl-C at any point of its first 50 ms never prints "Fatal Python error:
    init_import_site" or a traceback (the pip console script printed one in 4 of 5 tries of
    `krex run` on a busy machine). It ends with 130, or silently as SIGINT before the interpreter
    set its handlers, or, after the verb ended, with the verb's status."""
    if not SCRIPT.exists():
        pytest.skip(f"no installed krex command beside {sys.executable}")
    assert SCRIPT.read_text().startswith("#!/bin/sh"), f"{SCRIPT} is not krex's launcher: re-run setup"
    argv, done = EARLY[verb]
    seen: Counter[str] = Counter()
    for ms in range(0, 51, 3):
        rc, text = interrupted(argv, ms / 1000)
        assert "Fatal Python error" not in text and "Traceback" not in text, (ms, text)
        assert rc in (130, -signal.SIGINT) or rc in done, (ms, rc, text)
        seen["130" if rc == 130 else "other"] += 1
    assert seen["130"] >= 3, f"too few Ctrl-Cs landed in the start to show anything: {seen}"
