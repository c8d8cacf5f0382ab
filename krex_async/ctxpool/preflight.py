"""Can a pool's workers import what they are told to? Asked once, as `krex serve` starts.

A worker that cannot import a --pool-preload or --pool-init module dies while warming; after
upkeep.MAX_FAILURES such deaths in a row the pool stops warming for good and every command runs
plainly, which only `krex status` (failures, last_error) shows. So the daemon asks first, the way a
worker would meet the modules: the pool's interpreter, in the workers' directory, with their
environment and as their user (a module in the daemon's own ~/.local is not the pool user's).

Nothing is imported: each name is looked up as importlib.util.find_spec would, but a dotted name's
parents are looked up too rather than imported (their __init__ never runs: `torch.cuda` costs no
torch import); a submodule is also looked for where a legacy namespace __init__ (pkgutil's
extend_path) would extend its package's path to: the same directory under each sys.path entry.
A submodule that only its parent's import makes (`os.path`: os is no package) cannot be told
from a missing one without importing, and is taken on trust.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence

from krex_async.ctxpool.base import WORKER_CWD

TIMEOUT_S = 20.0  # an interpreter that cannot look up a few names in this long would not warm either

# Run as `python -c FIND name...`; prints the JSON list of the names not found, last on stdout.
FIND = r"""
import importlib.util, json, os, sys

def found(name):
    try:
        return lookup(name)
    except Exception:  # a finder that cannot tell without importing: taken on trust
        return True

def lookup(name):
    parts = name.split(".")
    spec = importlib.util.find_spec(parts[0])
    for i in range(1, len(parts)):
        if spec is None:
            return False
        where = spec.submodule_search_locations
        if where is None:  # a module, not a package: what it makes on import is not on disk
            return True
        full = ".".join(parts[: i + 1])
        # and where pkgutil.extend_path / pkg_resources.declare_namespace in its __init__ would
        # look: the same directory under every sys.path entry (a legacy namespace package)
        where = [*where, *(d for p in sys.path if isinstance(p, str)
                           if os.path.isdir(d := os.path.join(p, *parts[:i])) and d not in where)]
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if find is not None and (spec := find(full, where)) is not None:
                break
    return spec is not None

print(json.dumps([n for n in sys.argv[1:] if not found(n)]))
"""


class PreflightError(Exception):
    """The interpreter could not answer: it did not start, failed, or outlived the timeout."""


def bad_names(modules: Sequence[str]) -> list[str]:
    """The entries that are no dotted module name at all (`torch-nightly`, `.x`, `a..b`)."""
    return [m for m in modules if not all(p.isidentifier() for p in m.split("."))]


def missing_modules(
    modules: Sequence[str],
    *,
    python: str,
    env: Mapping[str, str],
    user: tuple[int, int, list[int]] | None = None,
    timeout: float = TIMEOUT_S,
) -> list[str]:
    """The `modules` that `python`, run in WORKER_CWD with `env` as `user` ((uid, gid, groups);
    None: ours), cannot find. Runs one short child (killed at `timeout`) and imports nothing.
    Raises ValueError for an entry that is no module name, PreflightError when the child gives
    no answer."""
    if bad := bad_names(modules):
        raise ValueError(f"not a module name: {', '.join(map(repr, bad))}")
    if not modules:
        return []
    try:
        p = subprocess.run(
            [python, "-c", FIND, *modules],
            cwd=WORKER_CWD,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            user=user[0] if user else None,
            group=user[1] if user else None,
            extra_groups=user[2] if user else None,
        )
    except subprocess.TimeoutExpired:
        raise PreflightError(f"{python} did not answer within {timeout:g} s") from None
    except OSError as e:
        raise PreflightError(f"cannot run {python}: {e.strerror or e}") from None
    lines = p.stdout.strip().splitlines()
    try:
        if p.returncode != 0 or not lines:
            raise ValueError
        missing = json.loads(lines[-1])
    except ValueError:
        said = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise PreflightError(f"{python} exited {p.returncode}: {said}") from None
    return [m for m in modules if m in missing]
