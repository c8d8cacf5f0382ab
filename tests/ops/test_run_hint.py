"""`krex run` of a Python that cannot import krex_async says why after the command's traceback."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from ..conftest import PY, py_env, run_daemon

SYSTEM_PY = shutil.which("python3", path="/usr/bin:/bin")


async def test_a_python_without_krex_gets_the_interpreter_to_use(tmp_path) -> None:
    if SYSTEM_PY is None:
        pytest.skip("no system python3 in /usr/bin or /bin")
    env = py_env()
    env.pop("PYTHONPATH")  # the system python must not find this checkout
    probe = subprocess.run([SYSTEM_PY, "-c", "import krex_async"], capture_output=True, env=env, cwd=tmp_path)
    if probe.returncode == 0:
        pytest.skip(f"{SYSTEM_PY} imports krex_async here: nothing to explain")
    async with run_daemon("--isolation", "signal") as d:
        p = subprocess.run(
            [
                PY,
                "-m",
                "krex_async",
                "run",
                "--socket",
                d.socket,
                "--no-stdin",
                "--",
                SYSTEM_PY,
                "-c",
                "from krex_async import region",
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )
    assert p.returncode == 1, p.stderr
    assert "No module named 'krex_async'" in p.stderr  # the command's own traceback, untouched
    hint = p.stderr.rstrip().splitlines()[-1]
    assert hint.startswith(f"krex run: the command's Python ({SYSTEM_PY}) cannot import krex_async"), hint
    assert PY in hint, hint
