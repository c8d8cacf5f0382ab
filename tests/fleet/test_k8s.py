"""packaging/k8s/: every manifest valid against the Kubernetes schemas (offline: the schemas ship in
the kubernetes-validate wheel), and the DaemonSet has what the daemon needs on a node."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from krex_async.daemon.config import ServeConfig, load_config_with_sources
from tests.conftest import ROOT

kv = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (test extra)")
yaml = pytest.importorskip("yaml")

K8S = ROOT / "packaging" / "k8s"
VERSIONS = ["1.28.0", "1.30.0", kv.latest_version()]


def docs() -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_strictly(version: str) -> None:
    found = docs()
    assert set(found) == {
        "Namespace/krex-system",
        "ConfigMap/krex-config",
        "DaemonSet/krex",
        "DaemonSet/krex-ray",
    }
    for doc in found.values():
        kv.validate(doc, version, strict=True)


def test_the_validator_rejects_what_is_wrong() -> None:
    """The check can fail: a wrong type and an unknown field are both errors."""
    ds = docs()["DaemonSet/krex"]
    bad = copy.deepcopy(ds)
    bad["spec"]["template"]["spec"]["hostPID"] = "yes"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, VERSIONS[-1], strict=True)
    bad = copy.deepcopy(ds)
    bad["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, VERSIONS[-1], strict=True)


def krex_config(text: str, tmp_path: Path) -> ServeConfig:
    """The ConfigMap's krex.toml as `krex serve --config` reads it (unknown keys are errors)."""
    path = tmp_path / "krex.toml"
    path.write_text(text)
    return load_config_with_sources(str(path), {}, {})[0]


def test_the_daemonset_gives_the_daemon_what_it_needs(tmp_path: Path) -> None:
    found = docs()
    pod = found["DaemonSet/krex"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["hostPID"] is True and c["securityContext"]["privileged"] is True
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    for path in ("/run/krex", "/sys/fs/cgroup", "/sys/kernel/tracing"):
        name = next(n for n, p in host.items() if p == path)
        assert mounts[name] == path
    assert "nvidia.com/gpu" in c["resources"]["limits"]
    config = krex_config(found["ConfigMap/krex-config"]["data"]["krex.toml"], tmp_path)
    assert config.socket.startswith(mounts[next(n for n, p in host.items() if p == "/run/krex")])
    assert config.state_dir.startswith("/run/krex/")
    assert config.cgroup_root.startswith("/sys/fs/cgroup/")
    assert config.cgroup_root in c["args"][0]  # the entrypoint creates it
    cfg = next(v for v in pod["volumes"] if "configMap" in v)
    assert cfg["configMap"]["name"] == "krex-config" and mounts[cfg["name"]] == "/etc/krex"


def test_the_ray_workers_take_the_token_from_a_secret_file_only() -> None:
    """Ray's token authentication on, the token a Secret's file (root only, mounted in the init
    container alone) copied for the Ray user (0600, theirs, in memory), named by its path: never a
    literal, an env value from the Secret, or an argument."""
    ds = docs()["DaemonSet/krex-ray"]
    pod = ds["spec"]["template"]["spec"]
    (ray,) = pod["containers"]
    (init,) = pod["initContainers"]
    env = {e["name"]: e for e in ray["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert "RAY_AUTH_TOKEN" not in env
    path = env["RAY_AUTH_TOKEN_PATH"]["value"]
    (mount,) = [m for m in ray["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount.get("readOnly") is True
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols[mount["name"]]["emptyDir"]["medium"] == "Memory"
    # The init container copies the Secret's file there, for the Ray user alone.
    (secret,) = [v for v in pod["volumes"] if "secret" in v]
    assert secret["secret"]["secretName"] == "krex-ray-token" and secret["secret"]["defaultMode"] == 0o400
    assert not [m for m in ray["volumeMounts"] if m["name"] == secret["name"]]
    src = next(m["mountPath"] for m in init["volumeMounts"] if m["name"] == secret["name"])
    dst = next(m["mountPath"] for m in init["volumeMounts"] if m["name"] == mount["name"])
    uid = pod["securityContext"]["runAsUser"]
    gid = pod["securityContext"]["runAsGroup"]
    name = secret["secret"]["items"][0]["path"]
    argv = [*init["command"], *init["args"]]
    assert argv == ["install", "-o", str(uid), "-g", str(gid), "-m", "600", f"{src}/{name}", path]
    assert path.startswith(dst + "/")
    assert "token" not in " ".join(ray["args"]).replace("RAY_AUTH_TOKEN_PATH", "")
    assert not ray["securityContext"].get("privileged")
    assert any(m["mountPath"] == "/run/krex" for m in ray["volumeMounts"])  # the daemon's socket


def test_ray_runs_unprivileged_and_the_daemon_grants_it_run_as(tmp_path: Path) -> None:
    """The Ray container (every Ray task on the node, the node agent included) runs as a non-root
    uid with no capability; the daemon container stays root; the daemon's config lets that uid ask
    for run_as, act on the commands it started (admin group) and reach the socket (its group)."""
    found = docs()
    pod = found["DaemonSet/krex-ray"]["spec"]["template"]["spec"]
    (ray,) = pod["containers"]
    uid, gid = pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]
    assert uid != 0 and pod["securityContext"]["runAsNonRoot"] is True
    assert ray["securityContext"]["runAsNonRoot"] is True and ray["securityContext"]["runAsUser"] == uid
    assert ray["securityContext"]["allowPrivilegeEscalation"] is False
    assert ray["securityContext"]["capabilities"]["drop"] == ["ALL"]
    daemon = found["DaemonSet/krex"]["spec"]["template"]["spec"]
    assert daemon.get("securityContext", {}).get("runAsUser", 0) == 0
    assert all(c.get("securityContext", {}).get("runAsUser", 0) == 0 for c in daemon["containers"])
    config = krex_config(found["ConfigMap/krex-config"]["data"]["krex.toml"], tmp_path)
    assert config.run_as_peer_list == [str(uid)]
    assert config.socket_group == config.admin_group == str(gid)
