"""What a CUDA out-of-memory failure means for a command: a re-run where it was co-located (others
held device memory while it ran), allowed (Submit.rerun_on_oom), fitting alone, and not re-run yet,
or re-run once guarded (admission.py: beside the others' peaks) and now to run alone; otherwise a
report that says whether the failure was co-location's or its own. Memory admission (admission.py)
runs the re-run; lifecycle.py acts."""

from __future__ import annotations

import msgspec

from krex_async.daemon.model.command import Command

REASON = "co-located OOM"
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
    # a first re-run that was guarded (beside others) may run once more, alone
    allowed = 2 if cmd.guarded else 1
    if cmd.spec.rerun_on_oom and cmd.reruns < allowed and fits_alone and not closing:
        return True
    if cmd.reruns:
        why = (
            "it was re-run once already" if cmd.reruns == 1 else "it was re-run twice already, the last alone"
        )
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
