"""Options `krex serve` took and then could not use, each now refused at start-up (exit 2, naming
the flag, KREX_* variable or file it came from): pool modules the pool's interpreter cannot find,
and launch-probe libraries that name no file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from krex_async.daemon.config import ConfigError, check_here, load_config_with_sources

from ..conftest import py_env
from .test_cli_input import serve

PY = sys.executable


def test_serve_refuses_pool_modules_its_interpreter_cannot_find(tmp_path: Path) -> None:
    """Such a pool's workers each died warming, the pool stopped after three (said only by
    `krex status`) and every command ran plainly: serve now says so before it serves."""
    rc, err = serve(
        tmp_path, "--isolation", "signal", "--pool-size", "1", "--pool-preload", "json,nosuchkrexmod"
    )
    assert rc == 2 and "flag --pool-preload: the pool's interpreter" in err, (rc, err)
    assert f"{PY} (as the daemon's user) cannot find module 'nosuchkrexmod'" in err, err
    assert "'json'" not in err, err
    env = py_env(KREX_POOL_INIT="colorsys,json.nosuchkrex")
    rc, err = serve(tmp_path, "--isolation", "signal", "--pool-size", "1", env=env)
    assert rc == 2 and "env KREX_POOL_INIT: the pool's interpreter" in err, (rc, err)
    assert "cannot find module 'json.nosuchkrex'" in err, err
    rc, err = serve(tmp_path, "--isolation", "signal", "--pool-size", "1", "--pool-preload", "torch-nightly")
    assert rc == 2 and "flag --pool-preload: not a module name: 'torch-nightly'" in err, (rc, err)


def test_pool_modules_are_looked_up_as_the_workers_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the daemon's environment (the workers inherit its PYTHONPATH), and only with a pool."""

    def check(**given: object) -> None:
        check_here(*load_config_with_sources(None, {}, {"isolation": "signal", **given}))

    (tmp_path / "hereonlykrex.py").write_text("")
    with pytest.raises(ConfigError, match=r"flag --pool-init: .* cannot find module 'hereonlykrex'"):
        check(pool_size=2, pool_init="hereonlykrex")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    check(pool_size=2, pool_preload="json,importlib.util", pool_init="hereonlykrex")
    check(pool_size=0, pool_preload="nosuchkrexmod", pool_init="nosuchkrexmod")  # no pool: unused


def test_serve_refuses_launch_libraries_that_name_no_file(tmp_path: Path) -> None:
    """find_libraries passed over a missing file or a pattern matching nothing without a word: the
    launch probe then ran on whatever its search found."""
    lib = tmp_path / "libcuda.so.1"
    lib.write_bytes(b"\x7fELF")
    missing = tmp_path / "lib" / "libcuda.so.1"
    rc, err = serve(
        tmp_path, "--isolation", "signal", "--probes", "launches", "--launch-libs", f"{lib},{missing}"
    )
    assert rc == 2 and f"flag --launch-libs: '{missing}': no such file" in err, (rc, err)
    env = py_env(KREX_LAUNCH_LIBS=f"{tmp_path}/nope*/libcuda.so*")
    rc, err = serve(tmp_path, "--isolation", "signal", "--probes", "auto", env=env)
    assert (
        rc == 2 and f"env KREX_LAUNCH_LIBS: pattern '{tmp_path}/nope*/libcuda.so*' matches no file" in err
    ), err

    def check(probes: str, libs: str) -> None:
        check_here(
            *load_config_with_sources(
                None, {}, {"isolation": "signal", "probes": probes, "launch_libs": libs}
            )
        )

    with pytest.raises(ConfigError, match=rf"flag --launch-libs: '{tmp_path}' is no regular file"):
        check("launches", str(tmp_path))
    with pytest.raises(ConfigError, match=r"flag --launch-libs: no library given"):
        check("auto", ",")
    check("launches", f"{lib},{tmp_path}/libcu*.so.*")  # a file, and a pattern matching one
    for unused in ("off", "ioctl", "tracefs"):  # these probes take no library
        check(unused, str(missing))
