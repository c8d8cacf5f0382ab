"""Options `krex serve` took and then could not use, each now refused at start-up (exit 2, naming
the flag, KREX_* variable or file it came from): pool modules the pool's interpreter cannot find,
launch-probe libraries that name no file, and a given cgroup root, now refused by the backend
chooser itself for every caller."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from krex_async.daemon.config import ConfigError, load_config_with_sources
from krex_async.daemon.startchecks import check_here
from krex_async.isolation import IsolationError, choose_backend

from ..conftest import ROOT, py_env
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


def test_a_relative_pythonpath_is_said_to_be_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`PYTHONPATH=. krex serve --pool-preload mod` beside mod.py is refused rightly (workers
    start in krex's directory, where '.' points), but said only that mod could not be found."""
    (tmp_path / "besidekrex.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", f".{os.pathsep}{tmp_path}")
    check_here(*load_config_with_sources(None, {}, {"pool_size": 1, "pool_preload": "besidekrex"}))
    monkeypatch.setenv("PYTHONPATH", ".")
    with pytest.raises(ConfigError, match=r"cannot find module 'besidekrex'.* relative '\.' is taken from"):
        check_here(*load_config_with_sources(None, {}, {"pool_size": 1, "pool_preload": "besidekrex"}))


def test_serve_refuses_an_unknown_pool_user_naming_where_it_came_from(tmp_path: Path) -> None:
    """serve exited 1 with `krex: --pool-user 'x': no such user` whether the name came from the
    flag, KREX_POOL_USER or the config file: now a usage error (2) naming its source, as the other
    checked options are, with a pool or without (serve resolves the user either way)."""
    for pool in ((), ("--pool-size", "1")):
        rc, err = serve(tmp_path, "--isolation", "signal", "--pool-user", "nosuchkrexuser", *pool)
        assert rc == 2 and "flag --pool-user: 'nosuchkrexuser': no such user" in err, (rc, err)
    rc, err = serve(tmp_path, "--isolation", "signal", env=py_env(KREX_POOL_USER="99999999"))
    assert rc == 2 and "env KREX_POOL_USER: '99999999': no such user" in err, (rc, err)
    conf = tmp_path / "krex.toml"
    conf.write_text('pool_user = "nosuchkrexuser"\n')
    rc, err = serve(tmp_path, "--isolation", "signal", "--config", str(conf))
    assert rc == 2 and f"file {conf}: 'nosuchkrexuser': no such user" in err, (rc, err)
    check_here(*load_config_with_sources(None, {}, {"pool_user": "root" if os.geteuid() == 0 else ""}))


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
    rc, err = serve(tmp_path, "--isolation", "signal", "--probes", "launches", env=env)
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
        check("launches", ",")
    check("launches", f"{lib},{tmp_path}/libcu*.so.*")  # a file, and a pattern matching one
    for unused in ("off", "ioctl", "tracefs"):  # these probes take no library
        check(unused, str(missing))


def test_under_probes_auto_launch_libraries_are_checked_only_where_bcc_runs(tmp_path: Path) -> None:
    """`--probes auto` runs launch uprobes only where bcc runs (open_probes): elsewhere it falls
    back to tracefs or no probes, which take no libraries, yet a missing --launch-libs entry was
    refused there too, so one krex.toml could not serve nodes with and without bcc. Now: refused
    where bcc runs (root here), a warning where it does not (the test user: eBPF needs root)."""
    from krex_async.probes import bcc_works
    from tests.security.helpers import USER_PY, _ensure_user, user_env

    if os.geteuid() != 0 or not bcc_works()[0]:
        pytest.skip("needs root, with bcc running here, to compare with a user it cannot run for")
    missing = "/nonexistent-krex/libcuda.so.1"
    with pytest.raises(ConfigError, match=rf"env KREX_LAUNCH_LIBS: '{missing}': no such file"):
        check_here(*load_config_with_sources(None, {"KREX_LAUNCH_LIBS": missing}, {"isolation": "signal"}))
    user = _ensure_user("krextest", [])
    r = user.run_py(
        "import json, sys; from krex_async.daemon.config import ConfigError, "
        "load_config_with_sources as load; from krex_async.daemon.startchecks import check_here; "
        "from krex_async.probes import open_probes\n"
        "notes = check_here(*load(None, {'KREX_LAUNCH_LIBS': sys.argv[1]}, {'isolation': 'signal'}))\n"
        "try:\n    check_here(*load(None, {}, {'probes': 'launches', 'launch_libs': sys.argv[1]}))\n"
        "    refused = ''\nexcept ConfigError as e:\n    refused = str(e)\n"
        "print(json.dumps([notes, refused, open_probes('auto', launch_libs=[sys.argv[1]])[1]]))",
        missing,
    )
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"the test user cannot import krex here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    [note], refused, reason = json.loads(r.stdout)
    assert note.startswith("env KREX_LAUNCH_LIBS: not used here: --probes auto (the default) runs"), note
    assert "bcc cannot run here (eBPF probes need root" in note, note
    assert refused.startswith(f"flag --launch-libs: '{missing}': no such file"), refused
    assert reason.endswith("; launch libraries unused: the launch uprobes need bcc"), reason
    # `krex serve` says so, and serves
    top = Path(tempfile.mkdtemp(prefix="krex-libs-", dir="/tmp"))
    os.chown(top, user.uid, user.gid)  # the user's own: a daemon refuses a directory others can write
    argv = [USER_PY, "-m", "krex_async", "serve", "--socket", str(top / "s"), "--state-dir", str(top / "st")]
    err = top / "err"
    try:
        with (
            open(err, "w") as f,
            subprocess.Popen(
                [*argv, "--isolation", "signal", "--devices", "cpu:1", "--log-format", "json"],
                user=user.uid,
                group=user.gid,
                env={**user_env(), "KREX_LAUNCH_LIBS": missing},
                cwd="/tmp",
                stdout=subprocess.DEVNULL,
                stderr=f,
            ) as p,
        ):
            try:
                deadline = time.monotonic() + 30
                while not (top / "s").exists() and p.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert (top / "s").exists(), (p.poll(), err.read_text())
            finally:
                p.terminate()
                p.wait(15)
        first = err.read_text().splitlines()[0]
        assert first.startswith("krex serve: warning: env KREX_LAUNCH_LIBS: not used here: "), first
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_choose_backend_refuses_a_given_root_it_cannot_use(tmp_path: Path) -> None:
    """The rule was krex serve's alone (check_here): choose_backend fell back to signals for a given
    root, so every other caller (serve() called directly, doctor) was told nothing."""
    state = str(tmp_path / "state")
    nope = tmp_path / "nope"
    for isolation in ("auto", "cgroup"):
        for root, why in ((nope, f"no directory {nope}"), (tmp_path, "is not a cgroup v2 directory")):
            with pytest.raises(IsolationError, match=why) as e:
                choose_backend(isolation, cgroup_root=str(root), state_dir=state)
            assert type(e.value).__name__ == "RootUnusable", e.value  # isolation.RootUnusable
            assert str(e.value).startswith(f"--cgroup-root {root}: ")
    assert not (tmp_path / "krex").exists()  # nothing was made in a directory that is no cgroup
    b = choose_backend("signal", cgroup_root=str(nope), state_dir=state)  # uses no root
    assert b.name == "signal"


def test_the_root_krex_finds_itself_still_falls_back_to_signals() -> None:
    """Unchanged: with no root given, auto takes signals where the cgroup tree is not writable (here:
    as `nobody`), and says why."""
    if os.geteuid() != 0:
        pytest.skip("running as another user needs root")
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 that `nobody` can run")
    code = (
        "import tempfile\nfrom krex_async.isolation import choose_backend\n"
        "with tempfile.TemporaryDirectory() as d:\n"
        "    for root in ('', None):\n"
        "        b = choose_backend('auto', cgroup_root=root, state_dir=d); print(b.name, b.reason)\n"
    )
    p = subprocess.run(
        [python, "-c", code],
        user="nobody",
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    if p.returncode != 0 and "ModuleNotFoundError" in p.stderr:
        pytest.skip(f"{python} cannot import krex_async as nobody: {p.stderr.strip().splitlines()[-1]}")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 2 and all(x.startswith("signal signal backend: ") for x in lines), lines


def test_serve_refuses_the_root_through_the_same_rule(tmp_path: Path) -> None:
    """check_here asks choose_backend's rule (isolation.root_problem) and names the source."""
    rc, err = serve(tmp_path, "--cgroup-root", str(tmp_path))
    assert rc == 2 and f"flag --cgroup-root: {tmp_path} is not a cgroup v2 directory" in err, (rc, err)
    assert "name a delegated cgroup v2 directory, or leave cgroup_root unset" in err, err
    d = Path(tempfile.mkdtemp(prefix="krex-root-", dir="/tmp"))
    try:
        conf = d / "krex.toml"
        conf.write_text(f'cgroup_root = "{d}/nope"\n')
        rc, err = serve(tmp_path, "--config", str(conf))
        assert rc == 2 and f"file {conf}: no directory {d}/nope" in err, (rc, err)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_serve_called_without_check_here_refuses_the_root_too(tmp_path: Path) -> None:
    """server.run(cfg), as an embedding program calls it, passes no check_here: it fell back to
    signals and served; the chooser's rule now stops it before anything is made."""
    code = (
        "import sys\nfrom krex_async.daemon import server\nfrom krex_async.daemon.config import ServeConfig\n"
        "sys.exit(server.run(ServeConfig(socket=sys.argv[1], state_dir=sys.argv[2], cgroup_root=sys.argv[3],"
        " probes='off')))\n"
    )
    sock, root = tmp_path / "s", tmp_path / "nope"
    try:
        p = subprocess.run(
            [PY, "-c", code, str(sock), str(tmp_path / "state"), str(root)],
            capture_output=True,
            text=True,
            env=py_env(),
            timeout=20,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("server.run served with a --cgroup-root it cannot use")
    assert p.returncode == 1 and f"krex: --cgroup-root {root}: no directory {root}; name a" in p.stderr, (
        p.stderr
    )
    assert "Traceback" not in p.stderr and not sock.exists()


def test_a_pool_user_who_cannot_run_the_worker_is_refused_without_preloads(tmp_path: Path) -> None:
    """Asked with no --pool-preload too: a --pool-user who cannot run krex's worker module (krex
    where that user cannot read it) had a pool whose every spawn failed, said only by `krex
    status`, while the same setup with a preload was refused. Asked of a copy of krex whose
    package only root may read, then of one anyone may."""
    if os.geteuid() != 0:
        pytest.skip("running as another user needs root")
    python = shutil.which("python3", path="/usr/bin:/bin")
    purelib = sysconfig.get_paths()["purelib"]
    if (
        python is None
        or subprocess.run([python, "-c", "import msgspec"], env={"PYTHONPATH": purelib}).returncode
    ):
        pytest.skip("no system python3 that can run krex with this venv's packages")
    top = Path(tempfile.mkdtemp(prefix="krex-pooluser-", dir="/tmp"))
    try:
        top.chmod(0o755)
        shutil.copytree(ROOT / "krex_async", top / "krex_async")
        ask = "import json; from krex_async.daemon.commands.pools import module_problems as m; "
        ask += "print(json.dumps(m('nobody', [], [])))"
        # the copy and this venv's packages (not a site dir: its .pth adding this tree is not read)
        env = {**py_env(), "PYTHONPATH": f"{top}{os.pathsep}{purelib}"}

        def problems() -> list[list[str]]:
            p = subprocess.run(
                [python, "-c", ask], env=env, cwd="/", capture_output=True, text=True, timeout=60
            )
            assert p.returncode == 0, p.stderr
            return json.loads(p.stdout)  # type: ignore[no-any-return]

        (top / "krex_async").chmod(0o700)
        [(field, why)] = problems()
        assert field == "pool_user" and "cannot find krex's worker module" in why, why
        assert f"under {top}" in why, why
        (top / "krex_async").chmod(0o755)
        assert problems() == []
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_daemon_that_is_not_root_may_name_itself_as_pool_user() -> None:
    """`--pool-user` naming the daemon's own user (a config shared with a root node, the gateway's
    --run-as) is the daemon's own: a daemon that is not root cannot set groups, and asking to did
    fail the start-up check (Operation not permitted) and every worker spawn."""
    if os.geteuid() != 0:
        pytest.skip("runs the check as another user: needs root")
    from tests.security.helpers import _ensure_user

    user = _ensure_user("krextest", [])
    r = user.run_py(
        "import json; from krex_async.daemon.commands.pools import module_problems, pool_identity as p; "
        "print(json.dumps([p('krextest'), p(str(__import__('os').getuid())), "
        "module_problems('krextest', ['json'], [])]))"
    )
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"the test user cannot import krex here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [None, None, []], r.stdout
