"""Every message between krex's daemon and its clients, and the framing that carries them.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack. The length is checked
against the limit before the body is read, so a hostile length allocates nothing. Messages are msgspec
Structs tagged by their `type` field, decoded into one of two unions: `Request` (client to daemon) and
`Reply` (daemon to client). Every request carries an `id` that the replies and streamed events for it
carry back. New fields always get defaults, so old peers keep decoding (msgspec schema evolution).

The first request on every connection is `Hello`, which carries the protocol version.
"""

from __future__ import annotations

import asyncio
import os
import struct
from typing import Annotated, Literal

import msgspec

PROTOCOL_VERSION = 1
# What a daemon honours beyond the messages of its version, said in Welcome.features: a field that
# asks for less than its message's default (Cancel.queued_only) is sent only to a daemon naming it,
# since an older one drops fields it does not know (forbid_unknown_fields=False) and does the more.
CANCEL_QUEUED_ONLY = "cancel.queued_only"
MEM_GATE = "mem_gate"  # MemGate requests are answered
FEATURES = (CANCEL_QUEUED_ONLY, MEM_GATE)
MAX_FRAME = 16 * 1024 * 1024
HEADER = struct.Struct(">I")

# Length bounds for strings and lists that come from peers (no unbounded fields).
MAX_NAME = 256  # characters of a label, device or region name (the CLI checks it too, by name)
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
MAX_ALIKE = 64  # features in a Submit's mem_alike
Text = Annotated[str, msgspec.Meta(max_length=1 << 20)]
Arg = Annotated[str, msgspec.Meta(max_length=128 * 1024)]
Argv = Annotated[list[Arg], msgspec.Meta(min_length=1, max_length=4096)]
Env = Annotated[dict[Annotated[str, msgspec.Meta(max_length=4096)], Arg], msgspec.Meta(max_length=4096)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]
ReqId = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
PID_MAX = 1 << 22  # the kernel's PID_MAX_LIMIT: no pid is larger
Pid = Annotated[int, msgspec.Meta(ge=-1, le=PID_MAX)]  # 0 (or -1): not given
# What exec accepts in all (argv and environment together; Linux's ARG_MAX is a quarter of the stack
# limit, 2 MiB by default) and the largest stdin a command can be given in its Submit frame.
MAX_EXEC_BYTES = 2 * 1024 * 1024
MAX_STDIN = 8 * 1024 * 1024


NODE_SOCKET = "/run/krex/krex.sock"  # the node's daemon (root's, the systemd unit's)
SUN_PATH_MAX = 108  # bytes of sockaddr_un.sun_path: a socket path must be shorter


def default_socket() -> str:
    """$KREX_SOCKET, else /run/krex/krex.sock as root, else $XDG_RUNTIME_DIR/krex.sock."""
    if os.environ.get("KREX_SOCKET"):
        return os.environ["KREX_SOCKET"]
    if os.geteuid() == 0:
        return NODE_SOCKET
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/krex-{os.getuid()}"
    return os.path.join(runtime, "krex.sock")


class Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=False, omit_defaults=True):
    pass


# ---------------------------------------------------------------------------------------- requests


class Hello(Msg, tag="hello"):
    id: ReqId = 0
    version: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = PROTOCOL_VERSION
    role: Literal["agent", "command"] = "agent"
    client: Name = ""


class Submit(Msg, tag="submit"):
    """Start a command. Replies: Accepted, then Output events, then Exited (or Error)."""

    id: ReqId
    argv: Argv
    cwd: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    env: Env | None = None  # None: the agent's environment is not passed; the daemon's minimal one is
    device: Name = "auto"  # "auto", an index ("0"), a key ("cpu", "nvidia0"), or "none"
    timeout: Seconds | None = None
    mem: Annotated[int, msgspec.Meta(ge=0, le=2**60)] = 0  # bytes of device memory the command needs
    stdin: Annotated[bytes, msgspec.Meta(max_length=MAX_STDIN)] | None = None  # then closed;
    # None: /dev/null
    on_disconnect: Literal["kill", "keep"] = "kill"
    stream: bool = True  # send Output events (False: only keep the output for the report)
    label: Name = ""
    # Run as this uid (its passwd entry's primary group and groups) instead of the peer's: only a
    # root peer may ask for another uid (the HTTP gateway runs its jobs as --run-as this way).
    run_as: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 2)] | None = None
    # stdin a pipe that StdinData requests fill (krex run's default), instead of `stdin`'s bytes
    stdin_stream: bool = False
    # Memory-aware admission: what commands that need alike share (their learned footprint;
    # default: the label, else argv[0] and argv[1]), and whether a CUDA out-of-memory failure
    # while others held the device's memory may be re-run, guarded or alone (the agent gets Rerun)
    mem_key: Name = ""
    rerun_on_oom: bool = False
    # What it shares with other commands whose peaks bound its own (the gateway: a digest of each
    # of a job's files and of its command); the tightest known is its need (footprints.py)
    mem_alike: Annotated[list[Name], msgspec.Meta(max_length=MAX_ALIKE)] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.stdin_stream and self.stdin is not None:
            raise ValueError("give either stdin (bytes) or stdin_stream, not both")
        # Each string is bounded by its type; their sum must also fit what exec accepts. Counted in
        # characters plus a terminator each (a lower bound of the bytes exec needs); raising here
        # makes the decoder answer a ValidationError.
        total = sum(len(a) + 1 for a in self.argv)
        if self.env is not None:
            total += sum(len(k) + len(v) + 2 for k, v in self.env.items())
        if total > MAX_EXEC_BYTES:
            raise ValueError(
                f"argv and env together are {total} characters, more than exec accepts ({MAX_EXEC_BYTES})"
            )


class Attach(Msg, tag="attach"):
    """Re-attach to a command (after a reconnect): replies as Submit, from its current state."""

    id: ReqId
    command: Name


class Cancel(Msg, tag="cancel"):
    id: ReqId
    command: Name
    signal: Annotated[int, msgspec.Meta(ge=1, le=64)] = 15
    # True: end it only while it is queued (never started), else Error not_queued and nothing is
    # done: the gateway's queue timeout then cannot kill a command that started as its cancel came.
    queued_only: bool = False


class StdinData(Msg, tag="stdin"):
    """More of a command's stdin (Submitted with stdin_stream). Replies Ok once written into its
    pipe (the next chunk should wait for it), or Error stdin_closed; eof closes the pipe."""

    id: ReqId
    command: Name
    data: Annotated[bytes, msgspec.Meta(max_length=1 << 20)] = b""
    eof: bool = False


class Status(Msg, tag="status"):
    id: ReqId


class RegionEnter(Msg, tag="region_enter"):
    """From inside a command: ask for exclusivity on its device. Reply: RegionGranted or Error."""

    id: ReqId
    command: Name
    token: Name
    name: Name = "region"
    pid: Pid = 0  # the requesting process (checked against SO_PEERCRED)
    freeze_own_children: bool = True
    warm_ms: Annotated[float, msgspec.Meta(ge=-1, le=60_000)] = -1.0  # -1: the daemon's default


class RegionExit(Msg, tag="region_exit"):
    id: ReqId
    region: Name
    token: Name
    drain: Literal["", "idle-verified", "timeout", "unverified", "not-needed"] = ""  # the owner's check
    drain_s: Seconds = 0.0
    warm_s: Seconds = 0.0


class QuiesceReady(Msg, tag="quiesce_ready"):
    """From a command's in-process runtime: it listens for quiesce requests on this connection."""

    id: ReqId
    command: Name
    token: Name
    pid: Pid = 0
    # Why this interpreter was not handed to the command's warm pool, where its runtime decided so
    # itself (flags, inherited fds, another interpreter): counted in the command's report.
    pool_declined: Name = ""


class Adopt(Msg, tag="adopt"):
    """From a command's interpreter at start-up, before any user code: run this process's program in
    a warm pool worker (ctxpool/adoption.py). Replies: Adopted (declined: run as a plain process; else
    the worker runs it), then AdoptExited with the worker's status. Everything a fresh interpreter
    would have started with comes along; fds 0/1/2 the worker takes itself (pidfd_getfd)."""

    id: ReqId
    command: Name
    token: Name
    argv: Argv  # sys.orig_argv
    cwd: Annotated[str, msgspec.Meta(max_length=4096)]
    env: Env
    executable: Arg = ""  # sys.executable as this interpreter computed it
    sys_path: Annotated[list[Arg], msgspec.Meta(max_length=4096)] = []  # before entry 0 is added
    hexversion: int = 0
    flags: dict[Name, int] = {}  # sys.flags by name
    xoptions: dict[Name, Arg] = {}
    warnoptions: Annotated[list[Arg], msgspec.Meta(max_length=256)] = []
    unbuffered: bool = False  # -u / PYTHONUNBUFFERED
    dont_write_bytecode: bool = False
    pycache_prefix: Arg | None = None
    umask: Annotated[int, msgspec.Meta(ge=0, le=0o777)] = 0o022
    ignored: Annotated[list[int], msgspec.Meta(max_length=128)] = []  # signals inherited as SIG_IGN
    mask: Annotated[list[int], msgspec.Meta(max_length=128)] = []  # signals blocked at start
    pid: Pid = 0
    # CLOCK_MONOTONIC seconds at which the interpreter blocked the signals it forwards (0: when
    # the daemon read this): the daemon's signals to the command since then reach the worker
    blocked_at: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class MemGate(Msg, tag="mem_gate"):
    """From a command's runtime, as its process first initialises CUDA (KREX_CUDA_GATE=1, set by a
    daemon with --mem-gate on): wait until memory admission lets the command use its device. The
    reply, Ok, comes then (at once where the command is not gated or has passed already)."""

    id: ReqId
    command: Name
    token: Name
    pid: Pid = 0


class QuiesceAck(Msg, tag="quiesce_ack"):
    id: ReqId
    region: Name
    synced: Name = ""  # what it synchronised: "torch", "cupy", "cuda", "hip", "none"
    seconds: Seconds = 0.0


class ExitHeld(Msg, tag="exit_held"):
    """From a command's runtime at interpreter exit, in a process holding a GPU file: it waits for
    a Resume before the exit frees its GPU memory (the driver's work of a context teardown, which
    no lock stops, would run beside a region's timing). `region`: the region that locked it (Held),
    whose release resumes it; "": the daemon resumes it at once, or at the end of the region of
    another command that runs on its device."""

    id: ReqId
    region: Name
    pid: Pid = 0


class Subscribe(Msg, tag="subscribe"):
    """Stream trace events (region boundaries, freezes, probe events) until the connection closes."""

    id: ReqId
    probes: bool = True


class Timeline(Msg, tag="timeline"):
    """The daemon's recent trace records (a bounded ring), in TimelineChunk replies."""

    id: ReqId


Request = (
    Hello
    | Submit
    | Attach
    | Cancel
    | Status
    | RegionEnter
    | RegionExit
    | QuiesceReady
    | QuiesceAck
    | ExitHeld
    | Subscribe
    | Timeline
    | StdinData
    | Adopt
    | MemGate
)


# ----------------------------------------------------------------------------------------- reports


class LateLock(msgspec.Struct, omit_defaults=True):
    """A held sibling's process that answered the lock CUDA_ERROR_NOT_READY: it was inside a CUDA
    call (a copy, an allocation, a module load, a synchronise, its context's creation), and the
    region waited for the driver to lock it as that call ended (up to --lock-wait) before the
    grant. `command` is "" for a pool worker outside any command."""

    pid: int
    command: str
    # locked (after_s: both lock calls), exited, frozen (still inside the call after --lock-wait:
    # its command was frozen, hold_fallback says why) or unheld (a pool worker: no cgroup to freeze)
    outcome: str = "pending"
    after_s: float = 0.0
    attempts: int = 0
    strays: int = 0  # its GPU driver calls the probes saw while the region was held
    # cuCheckpointProcessGetState at the first NOT_READY: "running" means it already had a context
    # and was inside a driver call (not creating one); a CUDA_ERROR_* name: the driver knew no context
    state: str = ""


class RegionReport(msgspec.Struct, omit_defaults=True):
    """One region of a command: when it was asked for, what entering cost, how it ended."""

    region: str
    name: str
    device: str
    pid: int
    policy: str
    requested_at: float = 0.0  # unix seconds
    wait_s: float = 0.0  # queued behind other regions
    # its turn come, waited this long for siblings owed their share of the device (--hold-share),
    # which ran meanwhile; share_idle: those of them that did not use the time, not waited for
    share_wait_s: float = 0.0
    share_for: list[str] = []
    share_idle: list[str] = []
    select_s: float = 0.0  # choosing whom to freeze and whom to quiesce first
    quiesce_s: float = 0.0
    freeze_s: float = 0.0
    drain_s: float = 0.0
    cores_s: float = 0.0
    enter_s: float = 0.0  # request to grant, all steps
    held_s: float = 0.0
    exit_s: float = 0.0  # release: thaw and restore
    frozen: list[str] = []  # command ids frozen for it
    frozen_pids: int = 0
    cores: list[int] = []
    # synced, idle-verified, timeout, unverified (nothing to time with), not-needed; pending while held
    drain: str = "not-needed"
    drain_window_s: float = 0.0  # the idle window the owner's drain check was given (--drain-window)
    warm_s: float = 0.0  # the owner warmed the device's clocks for this long (warm_ms)
    settle_s: float = 0.0  # the daemon waited this long for the GPU clock to recover before the grant
    pool_wait_s: float = 0.0  # ... and for a pool worker's context creation in flight to end
    clock_mhz: int = 0  # the GPU's shader clock at the grant (0: unknown)
    clock_target_mhz: int = 0  # the clock a timing alone runs at (applications clock, else max)
    outcome: str = "open"  # released, expired, owner-died, shutdown, refused
    error: str = ""
    strays: int = 0
    stray_pids: list[int] = []
    first_strays: list[str] = []
    # Who each stray process was, read from /proc when its first stray event was attributed:
    # "ppid P, cgroup /path, cmd 'argv...'" (or "gone" when it had already exited). Up to 10.
    stray_procs: dict[int, str] = {}
    tainted: bool = False
    # How siblings were held (regions/policy.py): "lock" or "freeze" ("" when none were), and, when a lock was
    # asked for but could not serve on this region at all, why. Locked: commands whose GPU-holding
    # processes the CUDA driver locked (their other threads ran on); fenced: siblings left running
    # off the region cores; hold_fallback: command -> why it was frozen rather than locked.
    hold: str = ""
    hold_why: str = ""
    locked: list[str] = []
    locked_pids: list[int] = []
    fenced: list[str] = []
    hold_fallback: dict[str, str] = {}
    lock_s: float = 0.0  # the parallel lock step, first call to last answer
    lock_max_s: float = 0.0  # the slowest single cuCheckpointProcessLock
    unlock_s: float = 0.0
    # Siblings that could be neither locked nor frozen (a thread in uninterruptible sleep): left
    # running off the region cores, command -> why; the region is tainted and `taint` says why.
    unheld: dict[str, str] = {}
    taint: list[str] = []
    # Processes that answered the lock CUDA_ERROR_NOT_READY: waited for (--lock-wait) before the grant.
    lock_late: list[LateLock] = []
    # Processes of other commands holding a GPU file whose runtime deferred their exit to the
    # region's end (ExitHeld: locked by it, or exiting while it ran), and held commands that
    # ended while the region was held all the same (no runtime, os._exit, a kill): their GPU
    # memory was freed beside the timing, which on the H200 slowed a memory-bound kernel by 11%
    # for 0.1 s (bench/RESULTS.md section 0).
    exit_deferred: list[int] = []
    held_exited: list[str] = []
    exits_waited: list[int] = []  # exiting processes (deferred, or begun before), waited for
    exits_unfinished: list[int] = []  # ... and still exiting after the wait (then frozen)
    exits_starved: list[int] = []  # exits begun over --exit-starve ago: waited for as if in the kernel
    exits_wait_s: float = 0.0  # how long this entry waited for them
    pool_locked: list[int] = []  # the device's pool workers outside any command, locked
    # pool workers outside any command that hold a GPU file but could not be locked: pid -> why
    pool_unheld: dict[int, str] = {}


class CommandReport(msgspec.Struct, omit_defaults=True):
    command: str
    argv: list[str]
    device: str
    policy: str
    state: str  # exited, signaled, timeout, cancelled, shutdown, failed, lost (its daemon died)
    exit_code: int | None = None
    signal: int | None = None
    wall_s: float = 0.0
    queued_s: float = 0.0  # waiting for the device (policy command)
    cpu_user_s: float = 0.0
    cpu_system_s: float = 0.0
    started_at: float = 0.0
    ended_at: float = 0.0
    regions: list[RegionReport] = []
    error: str = ""
    label: str = ""
    via: str = "exec"
    start_latency_s: float | None = None
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    # The whole output, in files under the daemon's state dir readable by the submitter (--spool-limit
    # bytes per stream; "" when spooling is off). *_dropped: bytes written but not in the file (past
    # the limit, or after a spool error); spool_error names the failure, e.g. "ENOSPC: ...".
    stdout_spool: str = ""
    stderr_spool: str = ""
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    spool_error: str = ""
    # Python interpreters of the command's tree that a warm pool worker adopted at start-up, and why
    # the others were not ("flag -X", "fds", "interpreter", "no warm worker" ...: count each).
    pool_adopted: int = 0
    pool_declined: dict[str, int] = {}
    # Memory-aware admission: re-runs after a CUDA out-of-memory while co-located (this report is
    # the re-run's, its output too), why; oom: "co-located" or "alone" when it failed so; the
    # device memory it was taken to need (mem_source: declared, learned, typical, default, unknown) and
    # the most its processes were seen to hold
    reruns: int = 0
    rerun_reason: str = ""
    oom: str = ""
    mem_need: int = 0
    mem_source: str = ""
    mem_peak: int = 0
    # --mem-gate: seconds its first CUDA initialisation waited for memory admission (the command
    # ran, importing and making inputs, from its start until then); gate: "passed", "bypassed"
    # (it used the device without asking: no torch), "unused" (it never did), "" (not gated)
    gate_s: float = 0.0
    gate: str = ""


# ------------------------------------------------------------------------------------------ replies


class Welcome(Msg, tag="welcome"):
    id: ReqId
    version: int
    server: str
    policy: str
    uid: int = -1  # the peer as the daemon sees it
    features: list[str] = []  # FEATURES (none from a daemon older than them)


class Accepted(Msg, tag="accepted"):
    id: ReqId
    command: str
    device: str
    token: str = ""  # only to the command's own environment, never needed by agents
    queued: bool = False


class Started(Msg, tag="started"):
    id: ReqId
    command: str
    pid: int


class Output(Msg, tag="output"):
    id: ReqId
    command: str
    stream: Literal["stdout", "stderr"]
    data: bytes


class Exited(Msg, tag="exited"):
    id: ReqId
    report: CommandReport
    stdout_tail: bytes = b""  # for Attach after disconnect: what was not streamed
    stderr_tail: bytes = b""


class Rerun(Msg, tag="rerun"):
    """The command (Submit.rerun_on_oom) failed with CUDA out of memory while others held the
    device's memory: it runs again, alone; its output so far is void (the re-run's replaces it)."""

    id: ReqId
    command: str
    reason: str = ""


class RegionGranted(Msg, tag="region_granted"):
    """report.drain == "pending": some sibling did not acknowledge; the owner verifies the device
    is idle (up to drain_timeout seconds) before its timed loop and says how that ended at exit."""

    id: ReqId
    report: RegionReport
    drain_timeout: float = 0.0
    warm_ms: float = 0.0  # warm the device's clocks this long before the timed loop
    drain_window: float = 0.0  # the drain check's idle window (0: the runtime's own default)


class RegionReleased(Msg, tag="region_released"):
    id: ReqId
    report: RegionReport


class RegionRevoked(Msg, tag="region_revoked"):
    """Unsolicited, to the owner: its region outlived its lease and was taken back."""

    id: ReqId
    report: RegionReport


class Quiesce(Msg, tag="quiesce"):
    """To a command's runtime: stop at the next bytecode boundary, synchronise, acknowledge."""

    id: ReqId
    region: str


class Resume(Msg, tag="resume"):
    id: ReqId
    region: str


class Held(Msg, tag="held"):
    """To the runtime of a process the region locked: an exit now waits for the region's Resume."""

    id: ReqId
    region: str


class Adopted(Msg, tag="adopted"):
    """To an adopting interpreter: worker `pid` runs its program, or `declined` says why not."""

    id: ReqId
    pid: int = 0
    declined: str = ""


class AdoptExited(Msg, tag="adopt_exited"):
    """The adopting worker ended: returncode as subprocess reports it (< 0: killed by -returncode)."""

    id: ReqId
    returncode: int


class StatusReply(Msg, tag="status_reply"):
    id: ReqId
    status: dict[str, object]  # daemon-built JSON-able tree, for people and scripts


# The kinds of TraceEvent a daemon sends (`krex trace --kind` accepts these alone).
TRACE_KINDS = (
    "command_start",
    "command_end",
    "region_queued",
    "region_share_wait",  # its turn come, waiting for siblings owed their share (they run)
    "region_grant",
    "region_release",
    "freeze",
    "lock",
    "thaw",
    "unlock",
    "probe",
    "stray",
    "probes_failed",
)


class TraceEvent(Msg, tag="trace"):
    id: ReqId
    ts: float  # unix seconds
    kind: str  # one of TRACE_KINDS
    device: str = ""
    command: str = ""
    region: str = ""
    pid: int = 0
    detail: dict[str, object] = {}


class TimelineChunk(Msg, tag="timeline_chunk"):
    id: ReqId
    events: list[TraceEvent]
    last: bool = True


class Ok(Msg, tag="ok"):
    id: ReqId


class Error(Msg, tag="error"):
    id: ReqId
    code: str  # bad_frame, bad_request, unknown_command, forbidden, bad_device, bad_spec, busy ...
    message: str


Reply = (
    Welcome
    | Accepted
    | Started
    | Output
    | Exited
    | RegionGranted
    | RegionReleased
    | RegionRevoked
    | Quiesce
    | Resume
    | Held
    | StatusReply
    | TraceEvent
    | TimelineChunk
    | Ok
    | Error
    | Adopted
    | AdoptExited
    | Rerun
)


# ------------------------------------------------------------------------------------------ framing

_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)


class FrameError(Exception):
    """The peer sent something that is not a frame we accept; the message says what."""


def encode(msg: msgspec.Struct) -> bytes:
    """One frame: header and body in a single buffer (one write, one syscall)."""
    buf = bytearray(4)
    _encoder.encode_into(msg, buf, 4)
    HEADER.pack_into(buf, 0, len(buf) - 4)
    return bytes(buf)


class InboundBudget:
    """Bytes of frame bodies being read at once, over all connections that share it.

    A body larger than `small` is read only once its length fits in `limit` beside the others being
    read; until then the reader waits and the peer's bytes stay in the kernel (the stream reader
    pauses). Bodies up to `small` are not counted: each connection's stream reader may buffer that
    much anyway, and exempting them keeps hellos and requests flowing while big frames wait.
    """

    def __init__(self, limit: int, small: int = 0) -> None:
        self.limit = limit
        self.small = small
        self.used = 0
        self._waiters: list[asyncio.Future[None]] = []

    async def take(self, n: int) -> int:
        """Reserve `n` bytes, waiting as long as the caller lets it; returns what to release()."""
        if n <= self.small:
            return 0
        while self.used + n > self.limit:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                self._waiters.remove(fut)
        self.used += n
        return n

    def release(self, n: int) -> None:
        if n:
            self.used -= n
            for fut in self._waiters:
                if not fut.done():
                    fut.set_result(None)


async def read_frame(
    reader: asyncio.StreamReader,
    max_frame: int = MAX_FRAME,
    body_timeout: float | None = 30.0,
    budget: InboundBudget | None = None,
) -> bytes | None:
    """The next frame's body, or None at a clean end of stream between frames.

    A peer may stay silent between frames for as long as it likes, but once a frame's first byte has
    arrived the rest of it (header and body) must arrive within `body_timeout` (slow senders).
    With a `budget`, the body is read only once it fits (waiting counts against `body_timeout`),
    and its bytes are given back when this returns: the caller must not keep the body across an
    await. Raises FrameError for an oversize length (checked before anything of the body is read,
    so it allocates nothing), a body larger than the whole budget, a wait for the budget that
    outlasts `body_timeout`, or a stream that ends mid-frame; TimeoutError for a slow frame.
    """
    try:
        first = await reader.readexactly(1)
    except asyncio.IncompleteReadError:
        return None
    taken = 0
    waiting = False
    try:
        async with asyncio.timeout(body_timeout):
            try:
                head = first + await reader.readexactly(3)
            except asyncio.IncompleteReadError:
                raise FrameError("stream ended inside a frame header") from None
            (n,) = HEADER.unpack(head)
            if n > max_frame:
                raise FrameError(f"frame of {n} bytes exceeds the limit of {max_frame}")
            if budget is not None:
                if n > budget.limit:
                    raise FrameError(
                        f"frame of {n} bytes exceeds the inbound budget of "
                        f"{budget.limit} (--max-inbound-bytes)"
                    )
                waiting = True
                taken = await budget.take(n)
                waiting = False
            try:
                return await reader.readexactly(n)
            except asyncio.IncompleteReadError:
                raise FrameError(f"stream ended inside a frame of {n} bytes") from None
    except TimeoutError:
        if waiting and budget is not None:
            raise FrameError(
                f"frame of {n} bytes waited {body_timeout} s for room in the inbound "
                f"budget of {budget.limit} bytes (--max-inbound-bytes)"
            ) from None
        raise
    finally:
        if budget is not None:
            budget.release(taken)


def decode_request(body: bytes) -> Request:
    """Raises msgspec.DecodeError / ValidationError with a message naming the bad field."""
    return request_decoder.decode(body)


def decode_reply(body: bytes) -> Reply:
    return reply_decoder.decode(body)


def to_builtins(obj: object) -> object:
    return msgspec.to_builtins(obj)
