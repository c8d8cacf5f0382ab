"""`krex serve` at its edges: paths it cannot serve on refused before anything is made (exit 2,
naming the flag), and signals that come while it starts ending it as cleanly as later ones."""

from __future__ import annotations

from pathlib import Path

from .test_cli_input import krex

QUIET = ("--isolation", "signal", "--probes", "off")  # a daemon that served by mistake holds nothing


def test_a_socket_in_a_missing_directory_is_refused_and_nothing_is_made(tmp_path: Path) -> None:
    """The daemon made every missing directory of --socket (a typo left a tree behind); only its
    own default directories are made now."""
    missing = tmp_path / "no" / "dir"
    rc, err = krex("serve", "--socket", str(missing / "s"), "--state-dir", str(tmp_path / "st"), *QUIET)
    assert rc == 2 and f"--socket {missing}/s: no directory {missing}" in err, (rc, err)
    assert not (tmp_path / "no").exists() and not (tmp_path / "st").exists()
    (tmp_path / "file").write_text("")
    rc, err = krex(
        "serve", "--socket", str(tmp_path / "file" / "s"), "--state-dir", str(tmp_path / "st"), *QUIET
    )
    assert rc == 2 and f"{tmp_path}/file is not a directory" in err, (rc, err)


def test_a_state_dir_that_is_a_file_is_refused_by_its_flag(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    for state in (tmp_path / "file", tmp_path / "file" / "sub"):
        rc, err = krex("serve", "--socket", str(tmp_path / "s"), "--state-dir", str(state), *QUIET)
        assert rc == 2 and f"--state-dir {state}: not a directory" in err, (rc, err)
        assert "File exists" not in err and not (tmp_path / "s").exists()
