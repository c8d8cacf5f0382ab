"""Memory admission's gate bookkeeping in process: a real `Admission` on a real `Core` (a 1000 MiB
device, no vendor library), its commands in the states a daemon puts them in, and the sample's
figures given to `memsample.apply` as the thread would read them. The paths a daemon cannot be
steered into on demand (a command that ends while its sample is read, a second process asking
from inside the command's own region, a re-run while a process waits at the gate)."""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec

from krex_async import protocol as P
from krex_async.daemon.commands import footprints, memsample, reruns
from krex_async.daemon.commands.admission import Admission
from krex_async.daemon.commands.commitment import GROW_S, UNSEEN_S
from krex_async.daemon.config import ServeConfig
from krex_async.daemon.model.command import Command, CommandState, Tail
from krex_async.daemon.model.core import Core
from krex_async.devices.base import Device
from krex_async.isolation.base import Group
from krex_async.scheduler import Policy, Scheduler

from .test_region_engine import FakeBackend

DEV = "nvidia0"
MiB = 1 << 20


def admission(**cfg: Any) -> Admission:
    cpus = frozenset(os.sched_getaffinity(0))
    core = Core(
        config=ServeConfig(**{"mem_headroom": 0, **cfg}),  # type: ignore[arg-type]
        backend=FakeBackend(),
        devices=[
            Device(index=0, key=DEV, vendor="nvidia", name="fake", cpus=cpus, memory_total_bytes=1000 * MiB)
        ],
        node=None,
        scheduler=Scheduler(Policy.SHARED, [DEV]),
        commands={},
        pools={},
        trace=lambda *a, **k: None,
        track=lambda t: t,
        records=None,
        spool=None,
        all_cpus=cpus,
    )
    return Admission(core)


def added(adm: Admission, cid: str, spec: P.Submit) -> Command:
    """A command of `spec` on DEV, known to `adm`'s core and scheduler, not admitted yet."""
    cmd = Command(
        id=cid,
        spec=spec,
        uid=os.getuid(),
        gid=os.getgid(),
        device=adm.core.device(DEV),
        policy=Policy.SHARED,
        tail_limit=1024,
    )
    adm.core.commands[cid] = cmd
    adm.core.scheduler.add_command(cid, DEV)
    return cmd


def command(adm: Admission, cid: str, mem: int) -> Command:
    """A command that declared `mem` bytes, admitted by `adm` (gated where the gate applies)."""
    cmd = added(adm, cid, P.Submit(id=0, argv=["true"], mem=mem))
    started = adm.admit(cmd)
    cmd.state, cmd.group = (CommandState.RUNNING, Group(cid)) if started else (CommandState.QUEUED, None)
    return cmd


def sample(adm: Admission, used: int, held: dict[str, int]) -> None:
    """What the thread would read: the device's use, and per command what its processes hold."""
    memsample.apply(
        adm,
        {
            "used": {DEV: used},
            "held": held,
            "pool": {},
            "mapped": {DEV} if held else set(),
            "sampled": {cid: (DEV, c.group if (c := adm.core.commands.get(cid)) else None) for cid in held},
            "at": time.monotonic(),
        },
    )


def b_waits_behind_a() -> tuple[Admission, Command]:
    """A (800 MiB) passed its gate; B (500 MiB) asked and waits in the device's queue."""
    adm = admission()
    command(adm, "a", 800 * MiB)
    assert adm.ask(adm.core.commands["a"])
    b = command(adm, "b", 500 * MiB)
    assert not adm.ask(b) and list(adm.devices[DEV].waiting) == ["b"]
    return adm, b


async def test_a_command_that_ended_while_its_sample_was_read_is_not_counted_again() -> None:
    """A gated command that never asked ends while the sample that saw its memory is read: the
    sample must not put it back among the device's running commands (for good: a re-run waiting
    to run alone would wait for ever, and the next status after its retention would fail)."""
    adm = admission()
    dm = adm.devices[DEV]
    a = command(adm, "a", 100 * MiB)
    assert a.gate == "open" and a.id in dm.gated and a.id not in dm.running
    a.state = CommandState.ENDED
    adm.ended(a, oom=False)
    sample(adm, 100 * MiB, {"a": 100 * MiB})  # read before it ended, applied after
    assert a.id not in dm.running and a.id not in dm.gated and a.gate == "open"
    b = command(adm, "b", 100 * MiB)
    assert adm.ask(b) and b.gate == "passed" and dm.running == {"b"}


async def test_a_gated_command_seen_on_the_device_without_asking_is_counted() -> None:
    adm = admission()
    dm = adm.devices[DEV]
    a = command(adm, "a", 600 * MiB)
    sample(adm, 600 * MiB, {"a": 600 * MiB})
    assert a.gate == "bypassed" and dm.running == {"a"} and not dm.gated
    b = command(adm, "b", 600 * MiB)
    assert not adm.ask(b) and b.gate == "asked" and "waiting for memory" in b.mem_wait


async def test_a_cuda_start_in_its_own_region_lets_its_waiting_processes_go() -> None:
    """One process of B waits at the gate (A holds the memory); another of B's processes starts CUDA
    inside B's own region: B is admitted at once, and leaves the queue."""
    adm, b = b_waits_behind_a()
    dm = adm.devices[DEV]
    assert not adm.ask(b), "a second process of B waits as the first does"
    assert adm.ask(b, now=True) and "b" in dm.running and not dm.waiting


async def test_a_starting_command_counts_until_seen_holding_memory_for_at_most_unseen_s() -> None:
    """--mem-commit now: a command admitted just before a sample that did not see it allocate yet
    still counts its need; where no sample ever sees its memory (a daemon whose NVML pids are not
    its own) it counts for UNSEEN_S, not for ever on top of the reported use."""
    adm = admission()
    dm = adm.devices[DEV]
    a = command(adm, "a", 700 * MiB)
    assert adm.ask(a)
    sample(adm, 0, {})  # after its admission, before it allocated
    assert adm.committed(dm) == 700 * MiB
    a.mem_admitted -= UNSEEN_S + 1
    assert adm.committed(dm) == 0
    a.mem_admitted += UNSEEN_S + 1
    sample(adm, 300 * MiB, {"a": 300 * MiB})  # seen: what it uses now is in the reported use
    assert adm.committed(dm) == 300 * MiB


async def test_a_re_run_while_a_process_waits_at_the_gate_is_queued_once() -> None:
    adm, b = b_waits_behind_a()
    dm = adm.devices[DEV]
    b.reset_for_rerun("co-located OOM")
    adm.requeue(b)
    assert list(dm.waiting) == ["b"] and b.gate == "" and b.guarded


def gateway_job(adm: Admission, cid: str, mem: int = 0) -> Command:
    """A first run as the gateway submits it (rerun_on_oom; need unknown unless `mem` is declared),
    gated; it asks at its CUDA start and returns having passed or waiting."""
    cmd = added(adm, cid, P.Submit(id=0, argv=["true"], mem=mem, rerun_on_oom=True))
    assert adm.admit(cmd) and cmd.gate == "open"
    cmd.state, cmd.group = CommandState.RUNNING, Group(cid)
    adm.ask(cmd)
    return cmd


def oom_rerun(adm: Admission, cmd: Command) -> None:
    """`cmd` failed with a co-located out-of-memory and is put back in line (lifecycle._rerun);
    others run on its device, so nothing starts."""
    cmd.reset_for_rerun("co-located OOM")
    adm.requeue(cmd)
    assert adm.pump(DEV) == []


async def test_optimistic_first_runs_never_pass_a_waiting_re_run() -> None:
    """--mem-commit none (and auto for a job that allows a re-run): a first run starts whatever the
    memory, but not past a re-run that waits, alone (need unknown) or guarded (need known); and
    not beside one that runs alone, or (need unknown) beside a guarded one."""
    for mode in ("none", "auto"):
        adm = admission(mem_commit=mode)
        dm = adm.devices[DEV]
        a, b = gateway_job(adm, "a"), gateway_job(adm, "b")
        assert a.gate == b.gate == "passed" and dm.running == {"a", "b"}  # unknowns side by side
        oom_rerun(adm, b)
        assert b.solo and list(dm.waiting) == ["b"]
        c = gateway_job(adm, "c")
        assert c.gate == "asked" and c.mem_wait == f"queued behind 1 on {DEV}", c.mem_wait
        assert adm.pump(DEV) == [] and "waits to run alone" in b.mem_wait
        assert f"({b.id}: re-run" in c.mem_wait, c.mem_wait
        a.state = CommandState.ENDED
        assert adm.ended(a, oom=False) == [b]  # b alone; c does not start beside it
        assert "waiting for b, a re-run after a co-located out-of-memory" in c.mem_wait, c.mem_wait
        b.state = CommandState.ENDED
        assert adm.ended(b, oom=False) == [c]

        d = gateway_job(adm, "d", mem=300 * MiB)  # declared: guarded when re-run
        oom_rerun(adm, d)
        assert d.guarded and list(dm.waiting) == ["d"] and "waits for c (need unknown)" in d.mem_wait
        e = gateway_job(adm, "e")
        assert e.gate == "asked" and e.mem_wait == f"queued behind 1 on {DEV}", e.mem_wait
        assert adm.pump(DEV) == []
        c.state = CommandState.ENDED
        assert adm.ended(c, oom=False) == [d]
        assert "waiting for d, a guarded re-run, to end" in e.mem_wait, e.mem_wait


async def test_a_command_ending_while_others_wait_for_memory_asks_for_a_sample_at_once() -> None:
    """The last sample still counts an ended command's memory, so what waits for it could start only
    at the next sample (SAMPLE_S later): its end wakes the sample loop now. With nothing waiting,
    an end does not."""
    adm = admission()
    dm = adm.devices[DEV]
    a, c = command(adm, "a", 400 * MiB), command(adm, "c", 400 * MiB)
    assert adm.ask(a) and adm.ask(c)
    sample(adm, 800 * MiB, {"a": 400 * MiB, "c": 400 * MiB})
    b = command(adm, "b", 500 * MiB)
    assert not adm.ask(b) and list(dm.waiting) == ["b"]
    adm.wake.clear()
    a.state = CommandState.ENDED
    assert adm.ended(a, oom=False) == []  # the last sample's 800 MiB still has a's 400 in it
    assert adm.wake.is_set(), "no sample asked for while a command waits for memory"
    sample(adm, 400 * MiB, {"c": 400 * MiB})  # the sample the wake brings: b fits now
    assert adm.pump(DEV) == [b]
    adm.wake.clear()
    for x in (b, c):
        x.state = CommandState.ENDED
        adm.ended(x, oom=False)
    assert not adm.wake.is_set(), "a sample asked for with nothing waiting"


# torch 2.11's message on an H100 (session 26's pool at 12 at once): 30.60 GiB held, 6.00 GiB more
H100_OOM = (
    b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6.00 GiB. GPU 0 has a total capacity "
    b"of 79.18 GiB of which 5.95 GiB is free. Including non-PyTorch memory, this process has 30.60 GiB "
    b"memory in use. Process 908 has 42.60 GiB memory in use. Process 1048 has 14.00 MiB memory in use."
)


def test_an_out_of_memory_floor_is_what_the_process_held_and_what_it_asked_for_on_top() -> None:
    """reruns.floor reads torch's last message, in stderr before stdout: held plus tried (not
    another process's use, which the message lists too, however many come first); nothing where
    the message names no use of this process (a container's torch, older torch: a request alone
    bounds nothing), where the use is on another line, where no size is named (cuBLAS), or where a
    size is no size (a command's output is its own to write). Admission learns a floor for the
    command's keys where it fits the device alone, and counts it in fits_alone."""
    adm = admission()
    cmd = command(adm, "a", 0)

    def floor(err: bytes, out: bytes = b"") -> int:
        cmd.err, cmd.out = Tail(1 << 20), Tail(1 << 20)
        cmd.err.add(err)
        cmd.out.add(out)
        return reruns.floor(cmd)

    assert floor(b"Traceback ...\n" + H100_OOM + b"\n") == int(30.60 * 2**30) + 6 * 2**30
    others = b"".join(b"Process %d has 1.00 GiB memory in use. " % pid for pid in range(40))
    late = H100_OOM.replace(b"Including non-PyTorch", others + b"Including non-PyTorch")
    assert floor(late) == int(30.60 * 2**30) + 6 * 2**30
    small = H100_OOM.replace(b"6.00 GiB", b"512.00 KiB").replace(b"30.60 GiB", b"20 bytes")
    assert floor(b"first " + H100_OOM + b"\nthen " + small) == 512 * 1024 + 20
    assert floor(small, out=H100_OOM) == 512 * 1024 + 20, "stderr's message first"
    assert floor(b"", out=H100_OOM) == int(30.60 * 2**30) + 6 * 2**30
    assert floor(b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 KiB on device 0") == 0
    assert floor(H100_OOM.replace(b"Including non-PyTorch memory, ", b"\n")) == 0
    assert floor(b"RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`") == 0
    held = b" GiB. Including non-PyTorch memory, this process has 1.00 GiB memory in use."
    assert floor(b"CUDA out of memory. Tried to allocate 2" + held) == 3 * 2**30
    assert floor(b"CUDA out of memory. Tried to allocate " + b"9" * 400 + held) == 0
    learner = added(adm, "b", P.Submit(id=0, argv=["true"], label="wide"))
    learner.err.add(H100_OOM)
    adm.learn_floor(learner)  # 36.6 GiB: more than this 1000 MiB device holds: not learned
    assert learner.mem_floor == int(30.60 * 2**30) + 6 * 2**30 and not adm.fits_alone(learner)
    assert adm.need(P.Submit(id=0, argv=["true"], label="wide"), os.getuid()) == (0, "unknown")
    fits = added(adm, "c", P.Submit(id=0, argv=["true"], label="narrow"))
    fits.err.add(small.replace(b"512.00 KiB", b"700.00 MiB"))
    adm.learn_floor(fits)
    assert fits.mem_floor == 700 * MiB + 20 and adm.fits_alone(fits)
    assert adm.need(P.Submit(id=0, argv=["true"], label="narrow"), os.getuid()) == (700 * MiB + 20, "learned")


def learned(adm: Admission, cid: str, label: str) -> Command:
    """A command of `label` (its need learned), admitted at its gate."""
    cmd = added(adm, cid, P.Submit(id=0, argv=["true"], label=label))
    assert adm.admit(cmd)
    cmd.state, cmd.group = CommandState.RUNNING, Group(cid)
    assert adm.ask(cmd) and cmd.mem_source == "learned"
    return cmd


async def test_under_auto_a_learned_need_counts_what_it_has_still_to_take_until_reached() -> None:
    """--mem-commit auto: a command of learned need (600 MiB) seen at 100 counts 500 more on top
    of the device's use; nothing more once it has reached its need, or GROW_S after its admission,
    or under `now`; nor where the vendor's pids are not ours (its use, unseen by command, is in the
    device's already)."""
    for commit in ("auto", "now"):
        adm = admission(mem_commit=commit)
        adm.footprints.learn(os.getuid(), ["label wide"], 600 * MiB)
        dm = adm.devices[DEV]
        a = learned(adm, "a", "wide")
        sample(adm, 100 * MiB, {"a": 100 * MiB})
        assert adm.committed(dm) == (600 if commit == "auto" else 100) * MiB, commit
        a.mem_admitted -= GROW_S + 1
        assert adm.committed(dm) == 100 * MiB, "past GROW_S"
        a.mem_admitted += GROW_S + 1
        sample(adm, 600 * MiB, {"a": 600 * MiB})
        sample(adm, 300 * MiB, {"a": 300 * MiB})  # reached its need, then gave some back
        assert adm.committed(dm) == 300 * MiB
    adm = admission()
    adm.footprints.learn(os.getuid(), ["label half"], 400 * MiB)
    dm = adm.devices[DEV]
    a, b = learned(adm, "a", "half"), learned(adm, "b", "half")
    for c in (a, b):
        c.mem_admitted -= UNSEEN_S + 1
    sample(adm, 700 * MiB, {})  # pids not ours: neither is seen, their 700 only in the device's use
    assert not dm.mapped and a.mem_now == b.mem_now == 0 and adm.committed(dm) == 700 * MiB


async def test_mem_guard_want_keeps_a_re_runs_room_without_the_others_whole_life_peaks() -> None:
    """A (declared 500) peaked at 500 and holds 100 now; B's guarded re-run is guarded at 600.
    --mem-guard peak (the default): B waits, A taken at its 500, and the device is counted at
    every command's whole-life peak. want: B starts beside A's 100; running at 200 it counts the
    400 it has still to take on top of the device's use, and nothing more once it reached 600."""
    for guarding in ("peak", "want"):
        adm = admission(mem_guard=guarding)
        dm = adm.devices[DEV]
        a, b = command(adm, "a", 500 * MiB), command(adm, "b", 600 * MiB)
        assert adm.ask(a)
        sample(adm, 500 * MiB, {"a": 500 * MiB})
        sample(adm, 100 * MiB, {"a": 100 * MiB})
        b.reset_for_rerun("co-located OOM")
        adm.requeue(b)
        assert b.guarded and b.mem_guard == 600 * MiB
        started = adm.pump(DEV)
        if guarding == "peak":
            assert started == [] and "beside the others' peaks on nvidia0, 0.5 GiB free" in b.mem_wait
            continue
        assert started == [b] and dm.running == {"a", "b"}
        b.state = CommandState.RUNNING
        sample(adm, 300 * MiB, {"a": 100 * MiB, "b": 200 * MiB})
        assert adm.committed(dm) == 700 * MiB  # 300 used, 400 still to come for B
        sample(adm, 700 * MiB, {"a": 100 * MiB, "b": 600 * MiB})
        assert adm.committed(dm) == 700 * MiB


def guarded_beside_a(adm: Admission, mem: int = 300 * MiB) -> tuple[Command, Command]:
    """A (declared 100) and B (declared `mem`), both admitted at their gates."""
    a = command(adm, "a", 100 * MiB)
    assert adm.ask(a)
    b = command(adm, "b", mem)
    assert adm.ask(b)
    return a, b


async def test_under_mem_guard_want_a_re_run_counts_its_guard_not_its_failed_runs_figures() -> None:
    """--mem-guard want (found by review): B's failed run reached 600 (or showed a floor of 600
    while holding 400). Its re-run is guarded at 600 and, started, counts all of it until its own
    processes are seen: the failed run's peak and use are not the re-run's, so C (500) waits. Under
    auto, a re-run of learned need is counted once (its want, not its growth as well); where the
    vendor's pids are not ours, by its whole-life figures, not its want on top of the device's use."""
    for how in ("peak reached", "floor shown"):
        adm = admission(mem_guard="want", mem_commit="now")
        dm = adm.devices[DEV]
        _, b = guarded_beside_a(adm)
        if how == "peak reached":
            sample(adm, 700 * MiB, {"a": 100 * MiB, "b": 600 * MiB})
        else:
            sample(adm, 500 * MiB, {"a": 100 * MiB, "b": 400 * MiB})
            b.mem_floor = 600 * MiB  # as learn_floor would
        b.reset_for_rerun("co-located OOM")
        adm.requeue(b)
        sample(adm, 100 * MiB, {"a": 100 * MiB})
        assert b.guarded and b.mem_guard == 600 * MiB and b.mem_now == b.mem_peak == 0, how
        assert adm.pump(DEV) == [b]
        assert adm.committed(dm) == 700 * MiB, how
        c = command(adm, "c", 500 * MiB)
        assert not adm.ask(c) and "waiting for memory" in c.mem_wait, how
    adm = admission(mem_guard="want", mem_commit="auto")
    dm = adm.devices[DEV]
    assert adm.ask(command(adm, "a", 100 * MiB))
    adm.footprints.learn(os.getuid(), ["label job"], 600 * MiB)
    b = learned(adm, "b", "job")
    b.reset_for_rerun("co-located OOM")
    adm.requeue(b)
    sample(adm, 100 * MiB, {"a": 100 * MiB})
    assert b.guarded and adm.pump(DEV) == [b]
    b.state = CommandState.RUNNING
    sample(adm, 200 * MiB, {"a": 100 * MiB, "b": 100 * MiB})
    assert adm.committed(dm) == 700 * MiB, "a learned re-run counted twice (its want and its growth)"
    adm = admission(mem_guard="want", mem_commit="now")
    dm = adm.devices[DEV]
    _, b = guarded_beside_a(adm)
    b.mem_floor = 600 * MiB
    b.reset_for_rerun("co-located OOM")
    adm.requeue(b)
    assert adm.pump(DEV) == [b]
    b.state = CommandState.RUNNING
    for used in (500, 700):  # pids not ours: B's use only in the device's
        memsample.apply(
            adm,
            {
                "used": {DEV: used * MiB},
                "held": {},
                "pool": {},
                "mapped": set(),
                "sampled": {"a": (DEV, adm.core.commands["a"].group), "b": (DEV, b.group)},
                "at": time.monotonic(),
            },
        )
        assert not dm.mapped and adm.committed(dm) == 700 * MiB, used


def test_a_guarded_re_run_not_re_run_again_says_why() -> None:
    """A guarded re-run whose out-of-memory shows it would not fit alone, or that fails as the
    daemon stops, says so: not "re-run once already" (found by review)."""
    adm = admission()
    b = command(adm, "b", 300 * MiB)
    b.reruns, b.guarded, b.solo, b.co_located = 1, True, False, True
    b.spec = msgspec.structs.replace(b.spec, rerun_on_oom=True)
    for fits, closing, why in ((False, False, "would not fit alone"), (True, True, "shutting down")):
        b.report = P.CommandReport(
            command="b", argv=["true"], device=DEV, policy="shared", state="exited", exit_code=1
        )
        assert not reruns.verdict(b, ["a"], fits_alone=fits, closing=closing)
        assert why in b.report.error and "re-run once" not in b.report.error, b.report.error


def oom_message(held_mib: int, tried_mib: int) -> bytes:
    """torch's out-of-memory message on this 1000 MiB device: the process held `held_mib` and
    tried to allocate `tried_mib` more."""
    return (
        b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate %d.00 MiB. GPU 0 has a total "
        b"capacity of 1000.00 MiB of which 1.00 MiB is free. Including non-PyTorch memory, this process "
        b"has %d.00 MiB memory in use.\n" % (tried_mib, held_mib)
    )


async def test_a_sample_of_the_failed_run_applied_after_the_requeue_is_not_the_re_runs() -> None:
    """--mem-guard want (found by review): a sample read while B's failed run was alive (600) and
    applied after B was put back in line must not give the re-run that run's figures: its guard
    would count as reached, and C (500) would be admitted into B's room."""
    adm = admission(mem_guard="want", mem_commit="now")
    dm = adm.devices[DEV]
    _, b = guarded_beside_a(adm)
    failed = b.group
    sample(adm, 700 * MiB, {"a": 100 * MiB, "b": 600 * MiB})
    late = {
        "used": {DEV: 700 * MiB},
        "held": {"a": 100 * MiB, "b": 600 * MiB},
        "pool": {},
        "mapped": {DEV},
        "sampled": {"a": (DEV, adm.core.commands["a"].group), "b": (DEV, failed)},
        "at": time.monotonic(),
    }
    b.reset_for_rerun("co-located OOM")
    adm.requeue(b)
    memsample.apply(adm, late)  # read before the requeue, applied after it
    assert b.mem_now == b.mem_peak == 0 and b.mem_guard == 600 * MiB
    assert adm.core.commands["a"].mem_now == 100 * MiB  # A's run is the one sampled
    sample(adm, 100 * MiB, {"a": 100 * MiB})
    assert adm.pump(DEV) == [b]
    b.state, b.group = CommandState.RUNNING, Group("b")  # its re-run's processes
    assert adm.committed(dm) == 700 * MiB  # 100 used, 600 for B's re-run still to take
    c = command(adm, "c", 500 * MiB)
    assert not adm.ask(c) and "waiting for memory" in c.mem_wait


async def test_a_re_runs_floor_above_its_guard_is_kept_though_its_processes_peaked_higher() -> None:
    """(found by review) B's first re-run is guarded at 300; its processes together reach 450 and
    its out-of-memory shows a floor of 400 (200 held, 200 tried) in one of them: more than it was
    guarded at, so its second re-run is guarded again (at 450), not run alone."""
    adm = admission()
    _, b = guarded_beside_a(adm)
    b.reset_for_rerun("co-located OOM")
    adm.requeue(b)
    assert b.guarded and b.mem_guard == 300 * MiB
    assert adm.pump(DEV) == [b]
    b.state, b.group = CommandState.RUNNING, Group("b")
    sample(adm, 550 * MiB, {"a": 100 * MiB, "b": 450 * MiB})
    b.err.add(oom_message(200, 200))
    adm.learn_floor(b)
    assert b.mem_floor == 400 * MiB
    b.reset_for_rerun("co-located OOM")
    adm.requeue(b)
    assert b.reruns == 2 and b.guarded and not b.solo and b.mem_guard == 450 * MiB


def test_a_floor_within_the_headroom_still_fits_alone() -> None:
    """(found by review) A command alone starts whatever the figures say: a floor of 960 on this
    1000 MiB device (within its 5% headroom) fits alone, and its failure beside another is
    re-run, not called its own."""
    adm = admission(mem_headroom=0.05)
    b = command(adm, "b", 0)
    b.err.add(oom_message(760, 200))
    adm.learn_floor(b)
    assert b.mem_floor == 960 * MiB and adm.fits_alone(b)
    assert adm.need(P.Submit(id=0, argv=["true"]), os.getuid()) == (960 * MiB, "learned")
    big = command(adm, "c", 0)
    big.err.add(oom_message(900, 200))
    adm.learn_floor(big)
    assert big.mem_floor == 1100 * MiB and not adm.fits_alone(big)
    assert adm.need(P.Submit(id=0, argv=["true"]), os.getuid()) == (960 * MiB, "learned")  # not learned


async def test_a_guarded_re_run_started_alone_is_guarded_at_a_need_learned_since() -> None:
    """--mem-guard want (found by review): B's re-run is guarded at 300, and its problem's need is
    learned as 800 while it waits. Started alone (the device empty), it is guarded at 800: C (500)
    is not admitted into the room B has still to take."""
    adm = admission(mem_guard="want", mem_commit="now")
    dm = adm.devices[DEV]
    adm.footprints.learn(os.getuid(), ["label job"], 300 * MiB)
    b = learned(adm, "b", "job")
    b.co_located = True
    b.reset_for_rerun("co-located OOM")
    adm.requeue(b)
    assert b.guarded and b.mem_guard == 300 * MiB
    adm.footprints.learn(os.getuid(), ["label job"], 800 * MiB)  # another of its problem ended
    assert adm.pump(DEV) == [b]  # alone
    assert b.mem_need == b.mem_guard == 800 * MiB
    b.state, b.group = CommandState.RUNNING, Group("b")
    sample(adm, 100 * MiB, {"b": 100 * MiB})
    assert adm.committed(dm) == 800 * MiB
    c = command(adm, "c", 500 * MiB)
    assert not adm.ask(c) and "waiting for memory" in c.mem_wait


def test_a_floor_is_learned_for_its_problem_not_for_its_kind() -> None:
    """(found by review, four times) A problem's out-of-memory floor is learned for that problem:
    its next candidate is taken at the floor, a job of another problem of its kind is not. A
    gateway job's key names its shape, which every problem of a set can share: under it, one
    problem failing twice filled three of the shape's remembered peaks, whose median is every new
    problem's typical need. Its features carry the floor to the problem's next candidate where
    its problem's file tells it apart; the digest of all its features (floor_key) carries it to the
    same job again where nothing does yet (a shape's first problem)."""

    def job(problem: str, candidate: str = "c1") -> P.Submit:
        alike = ["command 11", "file job.py 22", f"file problem.py {problem}", f"candidate {candidate}"]
        return P.Submit(id=0, argv=["true"], mem_key="gateway eval / shape", mem_alike=alike)

    def fails(adm: Admission, cid: str, spec: P.Submit, held: int, tried: int) -> None:
        cmd = added(adm, cid, spec)
        cmd.err.add(oom_message(held, tried))
        adm.learn_floor(cmd)
        assert cmd.mem_floor == (held + tried) * MiB

    def ran(adm: Admission, spec: P.Submit, peak: int) -> None:
        adm.footprints.learn(uid, footprints.alike_keys(spec) + footprints.mem_keys(spec), peak)

    uid = os.getuid()
    adm = admission()
    fails(adm, "w0", job("wide"), 500, 300)  # the shape's first problem
    assert adm.need(job("wide"), uid) == (800 * MiB, "learned")
    assert adm.need(job("wide", "c2"), uid) == (0, "unknown")  # nothing tells its problem apart yet
    assert adm.need(job("new"), uid) == (0, "unknown")
    adm = admission()
    ran(adm, job("wide"), 100 * MiB)
    fails(adm, "w0", job("wide"), 500, 300)  # it ran at 100 once, then failed beside others
    assert adm.need(job("wide"), uid) == (800 * MiB, "learned")
    adm = admission()
    for problem in ("a", "b"):
        ran(adm, job(problem), 100 * MiB)
    for i in range(8):  # a batch of its candidates fails side by side (a feature keeps eight peaks)
        fails(adm, f"w{i}", job("wide", f"c{i}"), 500, 300)
    assert adm.need(job("wide"), uid) == (800 * MiB, "learned")
    assert adm.need(job("wide", "c9"), uid) == (800 * MiB, "learned")  # its next candidate
    assert adm.need(job("new"), uid) == (100 * MiB, "typical")
    assert adm.need(job("a", "c2"), uid) == (100 * MiB, "learned")
    b = added(adm, "b", P.Submit(id=0, argv=["true"], mem_key="eval / wide"))  # no features: its key
    b.err.add(oom_message(500, 200))
    adm.learn_floor(b)
    assert adm.need(P.Submit(id=0, argv=["true"], mem_key="eval / wide"), uid) == (700 * MiB, "learned")
    assert adm.need(P.Submit(id=0, argv=["true"], mem_key="eval / narrow"), uid) == (0, "unknown")
