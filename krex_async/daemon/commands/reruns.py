"""What a CUDA out-of-memory failure means for a command: a re-run where it was co-located (others
held device memory while it ran), allowed (Submit.rerun_on_oom), fitting alone, and not yet run
alone after one (admission.requeue: guarded beside the others' peaks, again where its floor grew,
then alone); otherwise a report that says whether the failure was co-location's or its own.
Memory admission (admission.py) runs the re-run; lifecycle.py acts."""

from __future__ import annotations

import re

import msgspec

from krex_async.daemon.model.command import Command

REASON = "co-located OOM"
MAX_RERUNS = 3  # guarded, guarded again where its floor grew, alone
OOM_MARKERS = (
    b"CUDA out of memory",
    b"CUDA_ERROR_OUT_OF_MEMORY",
    b"torch.OutOfMemoryError",
    b"cudaErrorMemoryAllocation",
    b"hipErrorOutOfMemory",
    b"CUDA error: out of memory",  # a cudaMalloc outside torch's allocator (an extension's, NCCL's)
    # a CUDA library that could not get its own device memory (a handle's, a workspace): on an
    # H100 under region with the pool, a job lost to co-location as "other" (cuBLAS creating its
    # handle, session 22)
    b"CUBLAS_STATUS_ALLOC_FAILED",
    b"CUBLASLT_STATUS_ALLOC_FAILED",
    b"CUDNN_STATUS_ALLOC_FAILED",
    b"CUSOLVER_STATUS_ALLOC_FAILED",
    b"CUSPARSE_STATUS_ALLOC_FAILED",
    b"CUFFT_ALLOC_FAILED",
    b"HIPBLAS_STATUS_ALLOC_FAILED",
)


# torch's caching allocator's message (c10 format_size: "bytes", "KiB", "MiB", "GiB"): what the process
# held, its CUDA context and other libraries' memory included, and what it asked for on top. Sizes
# of at most 9 digits: a command's output is its own to write, and a longer number is no size
_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE = rb"([0-9]{1,9}(?:\.[0-9]{1,4})?) (bytes|KiB|MiB|GiB|TiB)\b"
_TRIED = re.compile(rb"CUDA out of memory\. Tried to allocate " + _SIZE)
_HELD = re.compile(rb"this process has " + _SIZE + rb" memory in use")


def _bytes(m: re.Match[bytes]) -> int:
    return int(float(m.group(1)) * _UNITS[m.group(2).decode()])


def floor(cmd: Command) -> int:
    """What the command's out-of-memory failure shows it needs at least, from the last torch
    message in its stderr (else its stdout): "Tried to allocate X" on top of "this process has Y
    memory in use", on that message's line. 0 where no message names both: torch names the
    process's use only where it finds the process among NVML's (not in a container without the
    host's pids) and only since 2.1, and a request alone is no bound of the need. On an H100 this
    read 36.6-42.6 GiB for element-wise jobs that peaked at 42.6 alone, where their failed runs'
    sampled peaks, and their kind's typical need (9.0 GiB), fell far short."""
    for buf in (cmd.err.buf, cmd.out.buf):  # torch's exception goes to stderr
        tail = bytes(buf[-65536:])
        tried = list(_TRIED.finditer(tail))
        if not tried:
            continue
        last = tried[-1]
        end = tail.find(b"\n", last.end())
        held = _HELD.search(tail, last.end(), end if end >= 0 else len(tail))
        return _bytes(last) + _bytes(held) if held else 0
    return 0


def is_oom(cmd: Command) -> bool:
    """Whether the command failed with a device out-of-memory error (its exit and its output)."""
    rep = cmd.report
    if rep is None or rep.state not in ("exited", "signaled") or rep.exit_code == 0:
        return False
    tails = bytes(cmd.err.buf[-65536:]) + bytes(cmd.out.buf[-65536:])
    return any(m in tails for m in OOM_MARKERS)


def verdict(cmd: Command, others: list[str], fits_alone: bool, closing: bool) -> bool:
    """True: re-run `cmd`. False: its report now says why not (`oom`: co-located or alone;
    `error`: the device, the commands beside it, and why no re-run)."""
    assert cmd.report is not None
    if not cmd.co_located:
        cmd.report = msgspec.structs.replace(cmd.report, oom="alone")
        return False
    # every run but one alone is re-run, at most MAX_RERUNS times (admission.requeue: guarded
    # once, twice where the floor grew, then alone)
    if cmd.spec.rerun_on_oom and not cmd.solo and cmd.reruns < MAX_RERUNS and fits_alone and not closing:
        return True
    if cmd.solo or cmd.reruns >= MAX_RERUNS:
        times = {1: "once", 2: "twice"}.get(cmd.reruns, f"{cmd.reruns} times")
        why = f"it was re-run {times} already" + (", the last alone" if cmd.solo else "")
    elif not fits_alone:
        why = "it would not fit alone either"
    elif closing:
        why = "the daemon is shutting down"
    else:
        why = "the submit did not allow a re-run (rerun_on_oom)"
    note = (
        f"CUDA out of memory while co-located on {cmd.device_key} with other commands "
        f"({', '.join(others) or 'since ended'}) or warm pool workers holding its memory; "
        f"not re-run: {why}"
    )
    error = f"{cmd.report.error}; {note}" if cmd.report.error else note
    cmd.report = msgspec.structs.replace(cmd.report, oom="co-located", error=error)
    return False
