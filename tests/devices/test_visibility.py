"""A command given a GPU sees that GPU alone, whatever visibility variables it inherited: HIP reads
CUDA_VISIBLE_DEVICES as well as its own, and ROCr's ROCR_VISIBLE_DEVICES narrows the devices before
HIP_VISIBLE_DEVICES indexes them, so an inherited ROCR_VISIBLE_DEVICES=1 with krex's
HIP_VISIBLE_DEVICES=0 (an AMD GPU without a hip uuid) was another GPU than the one krex chose."""

from __future__ import annotations

from krex_async import protocol as P
from krex_async.daemon.model.command import Command
from krex_async.devices.base import VISIBILITY_VARS, Device

INHERITED = {
    "ROCR_VISIBLE_DEVICES": "1",
    "CUDA_VISIBLE_DEVICES": "2",
    "GPU_DEVICE_ORDINAL": "3",
    "HIP_VISIBLE_DEVICES": "1",
    "KEEP": "me",
}


def command(device: Device) -> Command:
    spec = P.Submit(id=1, argv=["true"], env=dict(INHERITED))
    return Command(id="c1", spec=spec, uid=0, gid=0, device=device, policy=None, tail_limit=1024)


def test_an_amd_gpu_without_a_hip_uuid_is_the_only_one_visible() -> None:
    amd = Device(index=2, key="amd2", vendor="amd", name="MI300X", env={"HIP_VISIBLE_DEVICES": "2"})
    env = command(amd).environment("/run/krex.sock")
    assert {k: env.get(k) for k in VISIBILITY_VARS} == {
        "CUDA_VISIBLE_DEVICES": None,
        "HIP_VISIBLE_DEVICES": "2",
        "ROCR_VISIBLE_DEVICES": None,
        "GPU_DEVICE_ORDINAL": None,
    }
    assert env["KEEP"] == "me"


def test_an_nvidia_gpu_drops_the_amd_variables_and_sets_its_own() -> None:
    nv = Device(index=0, key="nvidia0", vendor="nvidia", name="H200", env={"CUDA_VISIBLE_DEVICES": "GPU-abc"})
    env = command(nv).environment("/run/krex.sock")
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-abc"
    assert not {"ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL"} & set(env)


def test_a_cpu_device_leaves_what_the_command_was_given() -> None:
    """The cpu stand-in chooses no GPU: a command on it keeps the variables it was given."""
    cpu = Device(index=0, key="cpu", vendor="cpu", name="cpu")
    env = command(cpu).environment("/run/krex.sock")
    assert {k: env[k] for k in VISIBILITY_VARS} == {k: INHERITED[k] for k in VISIBILITY_VARS}
