"""preflight.missing_modules: the pool's interpreter, as the pool's user and with its environment,
says which modules it cannot find, without importing any (a real child interpreter each time)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from krex_async.ctxpool.preflight import PreflightError, missing_modules

PY = sys.executable


def test_finds_modules_and_submodules_without_importing_them(tmp_path: Path) -> None:
    """A package whose __init__ would fail (and leave a mark) is found with its submodule, and
    nothing of it runs: a check that imported torch would cost seconds and a CUDA init."""
    pkg = tmp_path / "boomkrex"
    pkg.mkdir()
    mark = tmp_path / "imported"
    (pkg / "__init__.py").write_text(f"open({str(mark)!r}, 'w').close()\nraise SystemExit(9)\n")
    (pkg / "sub.py").write_text(f"open({str(mark)!r}, 'w').close()\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    # __main__ has no spec to find (find_spec raises): it is there, and taken on trust
    names = ["json", "importlib.util", "os.path", "boomkrex", "boomkrex.sub", "colorsys", "__main__"]
    assert missing_modules(names, python=PY, env=env) == []
    assert not mark.exists(), "the check imported the module it was asked about"
    bad = ["nosuchkrexmod", "json.nosuch", "boomkrex.nosuch", "nosuchkrexmod.sub"]
    assert missing_modules(["json", *bad], python=PY, env=env) == bad
    assert not mark.exists()


def test_looks_with_the_environment_it_is_given(tmp_path: Path) -> None:
    """The workers' environment (their PYTHONPATH), not the caller's, decides what is there."""
    (tmp_path / "onlyherekrex.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    assert missing_modules(["onlyherekrex"], python=PY, env=env) == ["onlyherekrex"]
    env["PYTHONPATH"] = str(tmp_path)
    assert missing_modules(["onlyherekrex"], python=PY, env=env) == []


def test_looks_as_the_user_it_is_given() -> None:
    """A module only root can read is missing for a pool of `nobody` (what its workers would meet),
    while one beside it that anyone can read is found."""
    if os.geteuid() != 0:
        pytest.skip("running as another user needs root")
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 that `nobody` can run")
    top = Path(tempfile.mkdtemp(prefix="krex-preflight-", dir="/tmp"))  # pytest's tmp is root's alone
    try:
        top.chmod(0o755)
        (top / "public").mkdir(mode=0o755)
        (top / "public" / "anyonekrex.py").write_text("")
        (top / "private").mkdir(mode=0o700)
        (top / "private" / "rootonlykrex.py").write_text("")
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{top}/public:{top}/private"}
        names = ["rootonlykrex", "anyonekrex", "json"]
        assert missing_modules(names, python=python, env=env) == []
        pw = pwd.getpwnam("nobody")
        user = (pw.pw_uid, pw.pw_gid, [pw.pw_gid])
        assert missing_modules(names, python=python, env=env, user=user) == ["rootonlykrex"]
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_no_answer_is_an_error_not_a_verdict(tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match=r"cannot run /nonexistent/python3"):
        missing_modules(["json"], python="/nonexistent/python3", env=dict(os.environ))
    slow = tmp_path / "slowpython"
    slow.write_text("#!/bin/sh\nexec sleep 30\n")
    slow.chmod(0o755)
    with pytest.raises(PreflightError, match=r"did not answer within 0.5 s"):
        missing_modules(["json"], python=str(slow), env=dict(os.environ), timeout=0.5)
    broken = tmp_path / "brokenpython"
    broken.write_text("#!/bin/sh\necho 'no site-packages here' >&2\nexit 4\n")
    broken.chmod(0o755)
    with pytest.raises(PreflightError, match=r"exited 4: no site-packages here"):
        missing_modules(["json"], python=str(broken), env=dict(os.environ))
    with pytest.raises(ValueError, match=r"not a module name: 'torch-nightly', 'a..b'"):
        missing_modules(["json", "torch-nightly", "a..b"], python=PY, env=dict(os.environ))


def test_a_namespace_package_split_over_path_entries_is_found(tmp_path: Path) -> None:
    """The halves of a namespace package in two PYTHONPATH entries: PEP 420 (no __init__) and the
    legacy kind whose __init__ calls pkgutil.extend_path, whose submodule is in the other half. A
    worker imports both (checked here by a real import); the check refused the legacy one."""
    for half in ("a", "b"):
        (tmp_path / half / "pep420krex").mkdir(parents=True)
        (tmp_path / half / "legacykrex").mkdir(parents=True)
        (tmp_path / half / "legacykrex" / "__init__.py").write_text(
            "__path__ = __import__('pkgutil').extend_path(__path__, __name__)\n"
        )
    (tmp_path / "a" / "pep420krex" / "one.py").write_text("")
    (tmp_path / "b" / "pep420krex" / "two.py").write_text("")
    (tmp_path / "b" / "legacykrex" / "sub.py").write_text("")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'a'}{os.pathsep}{tmp_path / 'b'}"}
    names = ["pep420krex", "pep420krex.one", "pep420krex.two", "legacykrex", "legacykrex.sub"]
    imported = subprocess.run(
        [PY, "-c", f"import {', '.join(names)}"], env=env, capture_output=True, text=True, timeout=60
    )
    assert imported.returncode == 0, imported.stderr  # what a worker would do
    assert missing_modules(names, python=PY, env=env) == []
    assert missing_modules(["legacykrex.nosuch", "pep420krex.nosuch"], python=PY, env=env) == [
        "legacykrex.nosuch",
        "pep420krex.nosuch",
    ]
