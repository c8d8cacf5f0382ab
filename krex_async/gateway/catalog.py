"""The job kinds a gateway offers: each runnable one built, each missing one with the reason. Its own
module because it names every kind, and `profile` builds on `eval` (kinds.py): imports run one way."""

from __future__ import annotations

import sys
from typing import Any

from krex_async.gateway import limits as L
from krex_async.gateway.kinds import Dev, Eval, find_evaluator
from krex_async.gateway.profile import Profile, find_profilers


def build(
    lim: L.Limits, accepted: frozenset[str], atrex_bench_root: str | None, python: str = sys.executable
) -> tuple[dict[str, Any], dict[str, str]]:
    """(runnable kinds by name, unavailable kinds -> why)."""
    kinds: dict[str, Any] = {"dev": Dev(lim, accepted)}
    missing = {"disassemble": "the krex gateway does not implement disassemble jobs"}
    runner, why = find_evaluator(atrex_bench_root)
    tools, no_tools = find_profilers()
    if runner is not None:
        kinds["eval"] = Eval(lim, accepted, runner, python)
    else:
        missing["eval"] = why
    if runner is not None and tools:
        kinds["profile"] = Profile(lim, accepted, runner, python, tools)
    else:
        missing["profile"] = "; ".join(x for x in (no_tools, why) if x)
    return kinds, missing
