"""The fleet's secrets and identities without Ray: which token files krex takes, how a request is
sealed and checked, and who a command may run as."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from krex_async.client.submit import KrexError
from krex_async.fleet import auth


def test_a_token_file_must_be_private_regular_and_not_empty(tmp_path: Path) -> None:
    good = auth.create_token(str(tmp_path / "d" / "token"))
    assert os.stat(good).st_mode & 0o777 == 0o600 and os.stat(os.path.dirname(good)).st_mode & 0o777 == 0o700
    assert len(auth.read_token(good)) == 64
    with pytest.raises(FileExistsError):
        auth.create_token(good)  # never overwrites
    link = tmp_path / "link"
    link.symlink_to(good)  # as a Kubernetes Secret's file is
    assert auth.read_token(str(link)) == auth.read_token(good)
    loose = tmp_path / "loose"
    loose.write_text("t" * 64)
    loose.chmod(0o640)
    with pytest.raises(KrexError, match="readable by others .mode 640.: chmod 600"):
        auth.read_token(str(loose))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(KrexError, match="is empty"):
        auth.read_token(str(empty))
    with pytest.raises(KrexError, match="not a regular file"):
        auth.read_token(str(tmp_path))
    with pytest.raises(KrexError, match="cannot be read"):
        auth.read_token(str(tmp_path / "missing"))


def test_a_token_file_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    theirs = tmp_path / "theirs"
    theirs.write_text("t" * 64)
    theirs.chmod(0o600)
    nobody = pwd.getpwnam("nobody")
    os.chown(theirs, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(KrexError, match=f"belongs to uid {nobody.pw_uid}"):
        auth.read_token(str(theirs))


def test_the_token_is_never_taken_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_AUTH_TOKEN", "in-the-environment")
    with pytest.raises(KrexError, match="unset RAY_AUTH_TOKEN"):
        auth.use_token(auth.create_token(str(tmp_path / "token")))


def test_a_sealed_request_opens_only_with_its_key_method_and_node() -> None:
    raw, mac = auth.seal(b"key", "run", "node1", {"user": "alice"})
    assert auth.open_sealed(b"key", "run", "node1", raw, mac) == {"user": "alice"}
    for key, method, node, r, m, why in [
        (b"other", "run", "node1", raw, mac, "not signed"),
        (b"key", "cancel", "node1", raw, mac, "signed for 'run' on 'node1'"),
        (b"key", "run", "node2", raw, mac, "signed for 'run' on 'node1'"),
        (b"key", "run", "node1", raw + b"x", mac, "not signed"),
        (b"key", "run", "node1", {"user": "alice"}, None, "unsigned"),
        (None, "run", "node1", raw, mac, "without token authentication"),
    ]:
        with pytest.raises(KrexError, match=why) as e:
            auth.open_sealed(key, method, node, r, m)
        assert e.value.code == "forbidden"


def test_commands_run_as_a_user_never_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.RUN_AS_ENV, raising=False)
    for root in (0, "0", "root"):
        with pytest.raises(KrexError, match="no command as root"):
            auth.identity(root)
        with pytest.raises(KrexError, match="no command as root"):
            auth.node_uid(str(root))
    nobody = pwd.getpwnam("nobody")
    assert auth.identity(nobody.pw_uid) == "nobody"
    assert auth.node_uid("nobody") == nobody.pw_uid
    with pytest.raises(KrexError, match="no user 'no-such-user-x' on this node"):
        auth.node_uid("no-such-user-x")
    with pytest.raises(KrexError, match="without an identity"):
        auth.node_uid(None)
    if os.geteuid() == 0:
        with pytest.raises(KrexError, match="KREX_FLEET_RUN_AS"):
            auth.identity(None)  # root names one
        monkeypatch.setenv(auth.RUN_AS_ENV, "nobody")
        assert auth.identity(None) == "nobody"
    else:
        assert auth.identity(None) == pwd.getpwuid(os.geteuid()).pw_name


@pytest.mark.parametrize(
    "address, local",
    [
        ("127.0.0.1:6379", True),
        ("localhost:1", True),
        ("[::1]:1", True),
        ("ray://127.0.0.1:10001", True),
        ("10.0.0.5:6379", False),
        ("head.svc:6379", False),
    ],
)
def test_loopback_addresses(address: str, local: bool) -> None:
    assert auth.loopback(address) is local
