"""Every command runs in a worker exactly as it runs as a plain process: compared byte for byte."""

from __future__ import annotations

import os
import re
import signal
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from krex_async.ctxpool import Pool, PoolConfig
from tests.ctxpool.conftest import CPU, PY, run_plain, run_pooled

# One pool for the whole module (its workers are single-use, so every case still gets a fresh one).
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pool() -> AsyncIterator[Pool]:
    p = Pool(CPU, PoolConfig(size=2, preload=["json", "decimal"]))
    await p.start()
    await p.wait_warm(timeout=30)
    yield p
    await p.close()


INFO = textwrap.dedent(r"""
    import os, signal, sys
    print(sys.argv, sys.orig_argv, sys.executable)
    print(os.getcwd(), sys.path[0], __name__, sorted(globals()))
    print(globals().get("__file__"), getattr(__loader__, "__name__", type(__loader__).__name__),
          __spec__ and __spec__.name, repr(__package__))
    print(sorted(os.environ.items()))
    print(sys.stdin.name, sys.stdout.name, sys.stdout.encoding, sys.stdout.errors, sys.stderr.errors,
          sys.stdout.line_buffering, sys.stderr.line_buffering, sys.stdout.isatty(), sys.stdout.mode)
    print([signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE,
                                         signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR1)])
    print(sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))
    print(os.getsid(0) == os.getpid(), os.getpgrp() == os.getpid(), oct(os.umask(0o22)))
    print(sys.path[1:])
    import __main__; print(__main__.__dict__ is globals())
    class A: pass
    import pickle; print(type(pickle.loads(pickle.dumps(A()))).__module__)
""")

RAISES = textwrap.dedent("""
    def inner(x):
        return {}[x]

    def outer():
        try:
            inner("key")
        except KeyError as e:
            raise ValueError("wrapped") from e

    outer()
""")

CASES: dict[str, tuple[list[str], bytes]] = {
    # the three forms, with argv, cwd, env, __main__, stdio and signal state
    "info -c": (["-c", INFO, "a", "-x", "--flag"], b""),
    "info -cJOINED": (["-c" + INFO, "b"], b""),
    "info script": (["sub/info.py", "a", "b c"], b""),
    "info script symlink": (["link.py", "z"], b""),
    "info -m": (["-m", "infomod", "arg"], b""),
    "info -m package": (["-m", "pkg", "p"], b""),
    # exit codes
    "exit none": (["-c", "import sys; sys.exit()"], b""),
    "exit 0": (["-c", "import sys; sys.exit(0)"], b""),
    "exit 7": (["-c", "import sys; print('out'); sys.exit(7)"], b""),
    "exit 261": (["-c", "raise SystemExit(261)"], b""),
    "exit -1": (["-c", "import sys; sys.exit(-1)"], b""),
    "exit str": (["-c", "import sys; sys.exit('fatal: no good')"], b""),
    "exit list": (["-c", "import sys; sys.exit([1, 2])"], b""),
    "exit True": (["-c", "raise SystemExit(True)"], b""),
    "exit in script": (["sub/exits.py"], b""),
    # uncaught exceptions: the same traceback text
    "raise -c": (["-c", "raise ValueError('boom')"], b""),
    "raise chained script": (["raises.py"], b""),
    "raise -m": (["-m", "raisesmod"], b""),
    "syntax error script": (["bad.py"], b""),
    "syntax error -c": (["-c", "x = ("], b""),
    "no such script": (["missing.py"], b""),
    "no such module": (["-m", "no_such_module_krex"], b""),
    "keyboard interrupt": (["-c", "raise KeyboardInterrupt"], b""),
    "custom excepthook": (
        ["-c", "import sys; sys.excepthook = lambda *a: print('hook', a[0].__name__); 1/0"],
        b"",
    ),
    # process-level endings
    "os._exit": (["-c", "import os; print('before', flush=True); os._exit(5)"], b""),
    "sigterm self": (["-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"], b""),
    "sigint self": (
        ["-c", "import os, signal, time; os.kill(os.getpid(), signal.SIGINT); time.sleep(1)"],
        b"",
    ),
    "sigkill self": (["-c", "import os; os.kill(os.getpid(), 9)"], b""),
    # C-level writes and children on the real fds
    "fd writes": (
        [
            "-c",
            "import os, subprocess; os.write(1, b'one\\n'); os.write(2, b'two\\n');"
            "subprocess.run(['echo', 'child']); os.system('echo sys >&2')",
        ],
        b"",
    ),
    "stdin python": (["-c", "import sys; d = sys.stdin.read(); print(len(d), repr(d))"], b"line 1\nline 2\n"),
    "stdin child": (["-c", "import os; os.system('cat'); print('after')"], b"fed to cat\n"),
    "stdin readline": (
        ["-c", "import sys; print(repr(sys.stdin.readline())); print(repr(input()))"],
        b"first\nsecond\nthird\n",
    ),
    # interpreter exit: atexit, threads, buffers
    "atexit and thread": (
        [
            "-c",
            textwrap.dedent("""
        import atexit, threading, time, sys
        atexit.register(lambda: print("atexit ran"))
        def late():
            time.sleep(0.2); print("thread done")
        threading.Thread(target=late).start()
        sys.stdout.write("no newline")
    """),
        ],
        b"",
    ),
    "atexit raising": (["-c", "import atexit; atexit.register(lambda: 1/0); print('main')"], b""),
    "warning": (["-c", "import warnings; warnings.warn('careful'); print('w')"], b""),
    "preloaded modules": (
        ["-c", "import json, decimal; print(json.dumps({'a': 1}), decimal.Decimal('1.1'))"],
        b"",
    ),
}


def _files(tmp: Path) -> None:
    (tmp / "sub").mkdir()
    (tmp / "sub" / "info.py").write_text(INFO)
    (tmp / "other").mkdir()
    (tmp / "other" / "real.py").write_text(INFO)
    os.symlink(tmp / "other" / "real.py", tmp / "link.py")
    (tmp / "infomod.py").write_text(INFO)
    (tmp / "pkg").mkdir()
    (tmp / "pkg" / "__init__.py").write_text("")
    (tmp / "pkg" / "__main__.py").write_text(INFO)
    (tmp / "sub" / "exits.py").write_text("import sys\nprint('x')\nsys.exit('from script')\n")
    (tmp / "raises.py").write_text(RAISES)
    (tmp / "raisesmod.py").write_text(RAISES)
    (tmp / "bad.py").write_text("print('ok')\nx = (\n")


def _norm(data: bytes) -> str:
    return re.sub(r"0x[0-9a-f]+", "0x...", data.decode())  # object addresses differ between any two runs


@pytest.mark.parametrize("case", list(CASES))
async def test_same_as_plain(pool, tmp_path: Path, case: str) -> None:
    args, stdin = CASES[case]
    _files(tmp_path)
    env = dict(os.environ, KREX_TEST_VAR="only in the command")
    env.pop("HOME", None)
    argv = [PY, *args]
    plain = await run_plain(argv, str(tmp_path), env, stdin)
    pooled = await run_pooled(pool, argv, str(tmp_path), env, stdin)
    assert _norm(pooled.stderr) == _norm(plain.stderr)
    assert _norm(pooled.stdout) == _norm(plain.stdout)
    assert pooled.returncode == plain.returncode
    assert pooled.launched.start_latency_s is not None


async def test_bare_python_name_through_path(pool, tmp_path: Path) -> None:
    """argv[0] 'python' resolved through the command's PATH: sys.executable as python computes it."""
    env = dict(os.environ, PATH=os.path.dirname(PY) + ":" + os.environ.get("PATH", ""))
    argv = [os.path.basename(PY), "-c", "import sys; print(sys.executable, sys.argv, sys.orig_argv)"]
    plain = await run_plain(argv, str(tmp_path), env)
    pooled = await run_pooled(pool, argv, str(tmp_path), env)
    assert (pooled.returncode, pooled.stdout, pooled.stderr) == (plain.returncode, plain.stdout, plain.stderr)


@pytest.mark.parametrize("ignored", [(signal.SIGHUP,), (signal.SIGHUP, signal.SIGINT)], ids=["nohup", "bg"])
async def test_signals_the_daemon_ignores_stay_ignored_as_for_a_plain_command(
    tmp_path: Path, ignored
) -> None:
    """A daemon started under nohup has SIGHUP ignored, and one started in the background of a
    script (`krex serve &`) SIGINT too: exec keeps them ignored for a plain command, whose Python
    then installs no SIGINT handler, and a pooled one must see the same (a worker reset them
    before: SIGINT to Python's handler until 2026-12-06)."""
    _files(tmp_path)
    old = {s: signal.signal(s, signal.SIG_IGN) for s in ignored}
    try:
        p = Pool(CPU, PoolConfig(size=1))
        await p.start()
        try:
            await p.wait_warm(timeout=30)
            argv = [PY, "sub/info.py"]
            plain = await run_plain(argv, str(tmp_path), dict(os.environ))
            pooled = await run_pooled(p, argv, str(tmp_path), dict(os.environ))
        finally:
            await p.close()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    assert "Handlers.SIG_IGN: 1>, <Handlers.SIG_DFL: 0>]" in plain.stdout.decode(), plain.stdout
    assert (signal.SIGINT in ignored) == ("[<Handlers.SIG_IGN: 1>," in plain.stdout.decode()), plain.stdout
    assert _norm(pooled.stdout) == _norm(plain.stdout)
