"""Running jobs: claim them from the store in order, run each as a krex command, record the result.

    HTTP submit -> store (queued) -> notify() -> loop: claim() -> running -> _run(job):
        fresh job dir <state>/jobs/<id>/, files written without following links, handed to the
        job's user (files.hand_over); clocks locked if asked (clocks.py)
        Client.submit(bash -c CMD, cwd=job dir, env + KREX_AUTO_REGION=1, run_as=job's uid)
            (its environment and result dict: command.py; queued there: queue_timeout.watch)
        timeout (from the command's start): SIGTERM, SIGKILL 2 s later (exit -15, as the reference)
        bounded output, CommandReport (regions) -> store.finish(succeeded|failed) -> waiters woken

Jobs go to the daemon as they are claimed; the daemon's policy (region, command, shared) decides who
may use the device when. The gateway only bounds how many run at once (`Limits.max_running`).
One connection to the daemon is shared by all jobs; when it is lost, the jobs on it fail with reason
`daemon_lost` (the daemon kills commands whose agent disconnected), and nothing is claimed until a
new connection is made (the queue waits). Cancelling a running job ends its krex command (SIGTERM,
then SIGKILL) and leaves the job cancelled with result and error null, as the reference does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sqlite3
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from krex_async.client.submit import Client, CommandHandle, KrexError
from krex_async.gateway import auth, clocks
from krex_async.gateway.command import admission_args, command_result, job_env
from krex_async.gateway.files import hand_over, low_space, remove_tree
from krex_async.gateway.limits import TERMINAL, Limits
from krex_async.gateway.queue_timeout import QueueTimeout, in_daemon_queue
from krex_async.gateway.store import RETRY_S, Store, disk_full, error, until_stored

KILL_GRACE = 2.0  # seconds between SIGTERM and SIGKILL when a job is cancelled or times out


class Kind(Protocol):
    """How one job kind becomes a command and how its result is read back."""

    def prepare(self, request: dict[str, Any], workdir: Path) -> tuple[list[str], float]:
        """Write what the job needs into workdir; return (argv, timeout_s). May raise OSError."""

    def complete(
        self, request: dict[str, Any], workdir: Path, result: dict[str, Any], owner: int | None
    ) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
        """(status, result, error) from the command's result dict; files the job wrote are read
        as files.read_job_file reads them (owner: the job's uid, None for the gateway's)."""


class JobRunner:
    """Owns the daemon connection and the running jobs' tasks; `stop()` ends both."""

    def __init__(
        self,
        store: Store,
        jobs_dir: Path,
        limits: Limits,
        socket: str | None,
        kinds: dict[str, Kind],
        on_change: Callable[[str], None],
        python: str = sys.executable,
        run_as: int | None = None,
        connect: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self.store = store
        self.run_as = run_as  # the jobs' uid where a job has none recorded (queued by an older one)
        self.python = python  # what `python` is in a job (shims, PATH)
        self.timed_out: set[str] = set()  # jobs the gateway ended for their timeout
        self.enders: set[asyncio.Task[None]] = set()  # SIGTERM-then-SIGKILL of cancelled jobs
        self.jobs_dir = jobs_dir
        self.limits = limits
        self.socket = socket
        self.kinds = kinds
        self.on_change = on_change
        self.shims: Path | None = None  # a directory with `python` for jobs' PATH
        self.env_names: frozenset[str] = frozenset()  # --job-env: more of the gateway's variables
        self.min_free = 0  # --min-free-space: below it on the state disk, nothing new starts
        self.client: Client | None = None
        self.daemon_error = ""
        self.waiting = ""  # why queued jobs are not being started now ("" when they are)
        self.policy = ""
        self.running: dict[str, asyncio.Task[None]] = {}
        self.handles: dict[str, CommandHandle] = {}  # job id -> its krex command, while it runs
        self.orphans = set(store.orphans)  # jobs a dead gateway left running: end their commands
        # Why jobs were queued again (their fleet node lost before they started), for their result
        self.requeued: dict[str, list[str]] = {}
        self.expiry: QueueTimeout | None = None  # --queue-timeout: also times the daemon's queue
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False
        # What makes the connection: a client with Client's shape (the fleet's, for --fleet).
        self._connect = connect or (lambda: Client.connect(self.socket, timeout=5))

    def notify(self) -> None:
        self._wake.set()

    def why_waiting(self, job_id: str, status: str) -> str:
        """Why a job has not started ("" if it has, or is not waiting): a queued one waits for a
        daemon, a node or a slot; a running one whose command the daemon queued waits there."""
        if status == "queued":
            return self.waiting or self._held_by_cap(job_id)
        h = self.handles.get(job_id)
        if status != "running" or h is None or not h.queued or h.pid is not None:
            return ""
        return in_daemon_queue(h.device, self.policy)

    def _held_by_cap(self, job_id: str) -> str:
        """Why a queued job waits for its own identity ("" when it does not)."""
        cap = self.store.max_running_per_owner
        owner = self.store.owner(job_id) if cap else None
        if owner is None or self.store.active(owner)[1] < cap:
            return ""
        return f"waiting for one of its identity's {cap} running jobs to end (--max-running-per-identity)"

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())
        self.notify()

    async def connect(self) -> Client | None:
        """The daemon connection, made again if it was lost; None (and `daemon_error`) if not."""
        if self.client is not None and self.client.connected:
            return self.client
        try:
            self.client = await self._connect()
        except KrexError as e:
            self.client, self.daemon_error = None, e.message
            return None
        self.daemon_error = ""
        self.policy = self.client.welcome.policy if self.client.welcome else ""
        if self.orphans:
            await self._reap(self.client)
        return self.client

    async def _reap(self, client: Client) -> None:
        """Kill the krex commands of jobs a previous gateway left running (found by label), so a
        job marked gateway_restarted is not still running behind its record."""
        labels = {f"gateway {j}" for j in self.orphans}
        try:
            status = await client.status()
            for c in status.get("commands", []):
                if c.get("label") in labels and c.get("state") in ("queued", "starting", "running"):
                    try:
                        await client.cancel(c["command"], 9)
                    except KrexError:
                        pass  # it ended meanwhile
        except KrexError:
            return  # try again on the next connection
        self.orphans.clear()

    async def _loop(self) -> None:
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            while not self._stopping and len(self.running) < self.limits.max_running:
                client = await self.connect()
                self.waiting = self.unready(client) or low_space(self.jobs_dir, self.min_free)
                if client is None or self.waiting:  # keep the queue; try again shortly
                    asyncio.get_running_loop().call_later(1.0, self._wake.set)
                    break
                try:
                    claimed = self.store.claim()
                except sqlite3.Error as e:  # locked past its timeout, disk full: the loop lives on
                    print(f"krex gateway: cannot claim a queued job ({e}); again in 1 s", file=sys.stderr)
                    asyncio.get_running_loop().call_later(1.0, self._wake.set)
                    break
                if claimed is None:
                    break
                job_id, kind, request = claimed
                self.on_change(job_id)
                task = asyncio.get_running_loop().create_task(self._run(client, job_id, kind, request))
                self.running[job_id] = task
                task.add_done_callback(functools.partial(self._done, job_id))

    def unready(self, client: Client | None) -> str:
        """Why no queued job can start now ("" when one can): no daemon, or a fleet with no node
        up (its jobs wait for one rather than fail)."""
        if client is None:
            return f"waiting for the krex daemon: {self.daemon_error or 'unreachable'}"
        fleet_down = getattr(client, "unavailable", None)  # FleetClient's
        why = fleet_down() if fleet_down is not None else ""
        return f"waiting for a fleet node: {why}" if why else ""

    def _done(self, job_id: str, _task: object = None) -> None:
        self.running.pop(job_id, None)
        self.on_change(job_id)
        self._wake.set()

    async def _run(self, client: Client, job_id: str, kind: str, request: dict[str, Any]) -> None:
        """Run one claimed job to a terminal status. Every failure becomes the job's error."""
        clock: clocks.Lock | None = None
        deadline: asyncio.Task[None] | None = None
        unqueue: asyncio.Task[None] | None = None
        try:
            runner = self.kinds[kind]
            uid = self.store.run_uid(job_id)
            if uid is None:
                uid = self.run_as
            if uid == 0 or (uid is None and os.geteuid() == 0):
                raise PermissionError("refusing to run a job as root")
            user = auth.user(str(uid)) if uid is not None else None
            workdir = self.jobs_dir / job_id
            try:
                try:
                    workdir.mkdir(mode=0o700)
                except FileExistsError:
                    # What a requeue (below) could not remove: this job's own (ids are unique), so
                    # it goes; remove_tree follows no link and refuses one in place of the directory.
                    await asyncio.to_thread(remove_tree, workdir)
                    workdir.mkdir(mode=0o700)
                (workdir / ".torch_extensions").mkdir(mode=0o700)
                argv, timeout = runner.prepare(request, workdir)
            except OSError as e:
                if not disk_full(e):
                    raise
                await self._requeue(job_id, workdir)  # accepted: it waits for space, not fails
                return
            hand_over(workdir, uid, user.gid if user else None)
            extra = request.get("env_vars") or {}
            env = job_env(job_id, workdir, extra, self.shims, self.python, user, self.env_names)
            if kind != "dev" and request.get("lock_clocks"):
                clock = await clocks.acquire()  # raises ClockError: the job fails saying why
            if self.store.status(job_id) != "running":
                return  # cancelled while being prepared
            client = await self.connect() or client  # lost while it was prepared (the clock lock)
            admission = admission_args(kind, request) if isinstance(client, Client) else {}
            h = await client.submit(
                argv,
                cwd=str(workdir),
                env=env,
                device="auto",
                timeout=timeout + KILL_GRACE + 5,
                label=f"gateway {job_id}",
                run_as=uid,
                **admission,
            )
            self.handles[job_id] = h
            try:
                self.store.set_command(job_id, h.command)
            except sqlite3.Error as e:  # shown in the job's view only: the job runs on
                print(f"krex gateway: job {job_id}: cannot record its command ({e})", file=sys.stderr)
            self.on_change(job_id)
            if self.store.status(job_id) == "cancelled":
                await self._terminate(h.command)
            deadline = asyncio.get_running_loop().create_task(self._deadline(job_id, h, timeout))
            if h.queued and self.expiry is not None:  # not started yet: the queue timeout still runs
                unqueue = asyncio.get_running_loop().create_task(self.expiry.watch(job_id, h, self.policy))
            out, err = bytearray(), bytearray()
            cut = {"stdout": False, "stderr": False}
            limit = self.limits.max_output
            reruns = {"reruns": True} if isinstance(h, CommandHandle) else {}
            async for stream, data in h.output(keep=False, **reruns):  # we keep `limit` of each, not h
                if stream == "rerun":  # the daemon runs it again: the first run's output is void
                    out.clear()
                    err.clear()
                    cut = {"stdout": False, "stderr": False}
                    deadline.cancel()  # its timeout counts from the re-run's start
                    deadline = asyncio.get_running_loop().create_task(self._deadline(job_id, h, timeout))
                    continue
                buf = out if stream == "stdout" else err
                room = limit - len(buf)
                if len(data) > room:
                    cut[stream] = True
                buf += data[: max(room, 0)]
            res = await h.wait()
            deadline.cancel()
            if await self._requeue_lost(job_id, h, res.report):
                return
            got = command_result(h, res.report, out, err, cut["stdout"], cut["stderr"])
            if self.requeued.get(job_id):  # it ran here after a node was lost before it started
                got["krex"]["requeued"] = self.requeued.pop(job_id)
            verdict: tuple[str, dict[str, Any] | None, dict[str, Any] | None]
            if self.expiry is not None and (late := self.expiry.judge(job_id, res.report)) is not None:
                verdict = "failed", None, late  # withdrawn from the daemon's queue
            else:  # off the event loop: a profile's CSV (up to 256 MiB) and the job's files are read
                verdict = await asyncio.to_thread(
                    self._judge, runner, job_id, request, workdir, res.report, got, timeout, uid
                )
            await self._record(job_id, *verdict)
        except KrexError as e:
            if e.code == "unreachable" and job_id not in self.handles and self.store.requeue(job_id):
                # Nothing started (a fleet whose nodes all went down meanwhile): back in line,
                # in its place, with a fresh job dir when it is claimed again (what is left now
                # goes then).
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(remove_tree, self.jobs_dir / job_id)
                return
            reason = "daemon_lost" if e.code == "disconnected" else "krex_error"
            await self._record(job_id, "failed", None, error(reason, f"krex: {e.message}", krex_code=e.code))
        except asyncio.CancelledError:
            with contextlib.suppress(sqlite3.Error):  # else the next start marks it gateway_restarted
                self.store.finish(
                    job_id, "failed", None, error("gateway_stopped", "the gateway stopped while the job ran")
                )
            raise
        except Exception as e:  # a bug or an OSError preparing the job: the job says so
            await self._record(job_id, "failed", None, error("execution_error", f"{type(e).__name__}: {e}"))
        finally:
            for task in (deadline, unqueue):
                if task is not None:
                    task.cancel()
            if self.expiry is not None:
                self.expiry.forget(job_id)
            with contextlib.suppress(sqlite3.Error):
                if self.store.status(job_id) != "queued":  # ended (or gone): its requeue notes too
                    self.requeued.pop(job_id, None)
            self.handles.pop(job_id, None)
            self.timed_out.discard(job_id)
            if clock is not None:
                self.on_change(job_id)  # decided above: its long polls answer now, not after the reset
                await clock.release()  # off the loop; runs to its end even if this task is cancelled

    async def _record(
        self, job_id: str, status: str, result: dict[str, Any] | None, err: dict[str, Any] | None
    ) -> None:
        """store.finish, tried again while the state disk is full: the verdict waits in memory, never
        left `running`; a gateway stopping meanwhile leaves it to the next (gateway_restarted)."""
        said = f"krex gateway: job {job_id} ended {status} but cannot be recorded"
        await until_stored(lambda: self.store.finish(job_id, status, result, err), said)

    async def _requeue(self, job_id: str, workdir: Path) -> None:
        """Back in line, in its place, for a job whose directory met a full disk before it started
        (after RETRY_S: the loop claims it again at once, and finds the disk as full)."""
        await asyncio.sleep(RETRY_S)
        with contextlib.suppress(OSError):
            await asyncio.to_thread(remove_tree, workdir)
        await until_stored(lambda: self.store.requeue(job_id))

    async def _requeue_lost(self, job_id: str, h: CommandHandle, report: Any) -> bool:
        """A fleet job whose node was lost before its command started there (it ran nothing) goes
        back to the queue in its place, its directory made afresh: True then. One that started is
        not run again: the gateway cannot know from a dead node how far it got."""
        if report.state != "lost" or h.pid is not None or self.store.status(job_id) != "running":
            return False
        if not self.store.requeue(job_id):  # ended meanwhile (cancelled)
            return False
        self.requeued.setdefault(job_id, []).append(f"{report.error}; it had not started there: queued again")
        with contextlib.suppress(OSError):
            await asyncio.to_thread(remove_tree, self.jobs_dir / job_id)
        return True

    async def _deadline(self, job_id: str, h: CommandHandle, timeout: float) -> None:
        """The job's timeout, counted from its start (not its wait in the daemon's queue); then
        SIGTERM, and SIGKILL after KILL_GRACE, as the reference gateway ends it (exit -15)."""
        while h.queued and h.pid is None:
            await asyncio.sleep(0.05)
        await asyncio.sleep(timeout)
        self.timed_out.add(job_id)
        await self._terminate(h.command)

    async def _terminate(self, command: str) -> None:
        """SIGTERM the command's tree, SIGKILL what is left after KILL_GRACE."""
        for sig, pause in ((15, KILL_GRACE), (9, 0.0)):
            if self.client is None:
                return
            try:
                await self.client.cancel(command, sig)
            except KrexError:
                return  # it ended meanwhile
            if pause:
                await asyncio.sleep(pause)
            if all(h.command != command for h in self.handles.values()):
                return

    def _judge(
        self,
        runner: Kind,
        job_id: str,
        request: dict[str, Any],
        workdir: Path,
        report: Any,
        result: dict[str, Any],
        timeout: float,
        uid: int | None,
    ) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
        if report.state == "timeout" or job_id in self.timed_out:
            return "failed", result, error("command_timeout", f"the job exceeded {timeout:g} seconds")
        if report.state == "cancelled":  # by an operator (`krex cancel`): as a gateway cancel
            return "cancelled", None, None
        if report.state == "lost":  # its daemon, or its node in a fleet, died while it ran
            return "failed", result, error("daemon_lost", report.error or report.state)
        if report.state in ("failed", "shutdown"):
            return "failed", result, error("krex_error", report.error or report.state)
        if result["stdout_truncated"] or result["stderr_truncated"]:
            return (
                "failed",
                result,
                error(
                    "output_too_large",
                    f"command output exceeded the {self.limits.max_output} byte stream limit",
                ),
            )
        return runner.complete(request, workdir, result, uid)

    async def cancel(self, job_id: str, owner: str | None = None) -> str | None:
        """Cancel a job; returns the status it had (None: no such job, or not `owner`'s). A running
        job's krex command gets SIGTERM, then SIGKILL, as the reference gateway's does."""
        before = self.store.cancel(job_id, owner)
        if before == "running":
            h = self.handles.get(job_id)
            if h is not None:
                task = asyncio.get_running_loop().create_task(self._terminate(h.command))
                self.enders.add(task)
                task.add_done_callback(self.enders.discard)
        if before is not None and before not in TERMINAL:
            self.on_change(job_id)
        return before

    async def stop(self, grace: float = 5.0) -> None:
        """Stop claiming, cancel running commands, close the daemon connection."""
        self._stopping = True
        self._wake.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
        # Decided first, so the cancellations below do not turn these jobs into `cancelled`.
        try:
            self.store.fail_all("running", "gateway_stopped", "the gateway stopped while the job ran")
        except sqlite3.Error as e:  # a full disk: the next start marks them gateway_restarted
            print(f"krex gateway: cannot record the running jobs as stopped ({e})", file=sys.stderr)
        for command in [h.command for h in self.handles.values()]:
            if self.client is not None:
                try:
                    await self.client.cancel(command, 9)
                except KrexError:
                    pass
        for ender in list(self.enders):
            ender.cancel()  # the SIGKILLs above end what they were waiting to end
        tasks = list(self.running.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        # A reset still on its thread: no clock left locked behind us, unless it hangs (NVML has
        # no timeout): then SIGTERM still ends the gateway, saying what to do.
        if not await clocks.settle(clocks.SETTLE_TIMEOUT):
            print(
                f"krex gateway: a GPU clock lock or reset still runs after {clocks.SETTLE_TIMEOUT:g} s;"
                f" stopping anyway: the clocks may still be locked: {clocks.RESET_HINT}",
                file=sys.stderr,
                flush=True,
            )
        if self.client is not None:
            await self.client.close()
