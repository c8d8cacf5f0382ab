"""What a CUDA out-of-memory failure means for a command: a re-run, alone, where it was co-located
(others held device memory while it ran), allowed (Submit.rerun_on_oom), not re-run yet and
fitting alone; otherwise a report that says whether the failure was co-location's or its own.
Memory admission (admission.py) detects the failure and runs the re-run; lifecycle.py acts."""

from __future__ import annotations

import msgspec

from krex_async.daemon.commands import Command

REASON = "co-located OOM"


def verdict(cmd: Command, others: list[str], fits_alone: bool, closing: bool) -> bool:
    """True: re-run `cmd`. False: its report now says why not (`oom`: co-located or alone;
    `error`: the device, the commands beside it, and why no re-run)."""
    assert cmd.report is not None
    if not cmd.co_located:
        cmd.report = msgspec.structs.replace(cmd.report, oom="alone")
        return False
    if cmd.spec.rerun_on_oom and not cmd.reruns and fits_alone and not closing:
        return True
    if cmd.reruns:
        why = "it was re-run once already"
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
