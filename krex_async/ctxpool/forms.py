"""Which command lines a pool can run, and what python itself would make of them.

A pool runs `python SCRIPT args`, `python -m MODULE args` and `python -c CODE args` (also the joined
`-mMODULE` / `-cCODE` spellings) when argv[0], looked up the way execvp would (spec.env's PATH, spec.cwd
for relative paths), is the pool's interpreter: same realpath and same virtual environment (a venv's
bin/python is a symlink to the base interpreter, but runs with other site-packages). Interpreter flags
(-u, -O, -I, -X ...) are declined, as are environment variables that change how the interpreter starts
(PYTHONPATH, locale ...) when they differ from the workers': the daemon then starts a plain process.

Imported by the worker: standard library only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# Variables read while the interpreter starts (or while a worker warms): a worker started with other
# values would not behave like a fresh process started with the command's.
INIT_VARS = frozenset(
    {
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSAFEPATH",
        "PYTHONNOUSERSITE",
        "PYTHONUSERBASE",
        "PYTHONUTF8",
        "PYTHONIOENCODING",
        "PYTHONUNBUFFERED",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONPYCACHEPREFIX",
        "PYTHONOPTIMIZE",
        "PYTHONDEBUG",
        "PYTHONVERBOSE",
        "PYTHONWARNINGS",
        "PYTHONHASHSEED",
        "PYTHONDEVMODE",
        "PYTHONFAULTHANDLER",
        "PYTHONTRACEMALLOC",
        "PYTHONMALLOC",
        "PYTHONCOERCECLOCALE",
        "PYTHONINTMAXSTRDIGITS",
        "PYTHONPLATLIBDIR",
        "PYTHONEXECUTABLE",
        "PYTHONNODEBUGRANGES",
        "PYTHONWARNDEFAULTENCODING",
        "LC_ALL",
        "LC_CTYPE",
        "LANG",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "CUDA_MODULE_LOADING",
        "PYTORCH_CUDA_ALLOC_CONF",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        # read once by the libraries a worker preloads, as they load or create the context
        "CUDA_LAUNCH_BLOCKING",
        "TORCH_USE_CUDA_DSA",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
    }
)


@dataclass(frozen=True)
class Form:
    kind: str  # "script", "module", "code"
    target: str  # the script path as given, the module name, or the code
    args: list[str]  # what follows


def parse(argv: list[str]) -> Form | None:
    """The form of a python command line, or None where the pool would not run it the same way."""
    if len(argv) < 2:
        return None  # the interactive interpreter
    a = argv[1]
    if a in ("-c", "-m"):
        if len(argv) < 3:
            return None
        return Form("code" if a == "-c" else "module", argv[2], argv[3:])
    if a.startswith("-c") or a.startswith("-m"):
        return Form("code" if a[1] == "c" else "module", a[2:], argv[2:])
    if a.startswith("-") or not a:
        return None  # a flag (or '-', '--'): not supported
    return Form("script", a, argv[2:])


def which(name: str, env: dict[str, str], cwd: str) -> str | None:
    """What execvp would run for argv[0]: a path as given (relative to cwd), else a PATH search."""
    if "/" in name:
        path = os.path.join(cwd, name)
        return path if os.access(path, os.X_OK) else None
    for d in env.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(cwd, d or ".", name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def executable_for(name: str, env: dict[str, str], cwd: str) -> str:
    """sys.executable as a fresh interpreter started as `name` computes it (absolute, not resolved)."""
    if "/" in name:
        return os.path.normpath(os.path.join(cwd, name))
    found = which(name, env, cwd)
    return os.path.normpath(found) if found else ""


def venv_of(executable: str) -> str | None:
    """The pyvenv.cfg that applies to an interpreter path (site.py looks beside it and one level up)."""
    d = os.path.dirname(executable)
    for cand in (os.path.join(d, "pyvenv.cfg"), os.path.join(os.path.dirname(d), "pyvenv.cfg")):
        if os.path.isfile(cand):
            return os.path.realpath(cand)
    return None


def same_interpreter(path: str, python: str) -> bool:
    return os.path.realpath(path) == os.path.realpath(python) and venv_of(path) == venv_of(python)


def init_key(env: dict[str, str]) -> tuple[tuple[str, str | None], ...]:
    return tuple((k, env.get(k)) for k in sorted(INIT_VARS))


# Flags an adopting interpreter may have been started with: the worker applies -u and -B (adopted.py,
# fresh.enter), and -R is the default. Any other flag declines the adoption.
OWN_FLAGS = frozenset("uBR")


def split_flags(argv: list[str]) -> tuple[str, list[str]]:
    """(the leading flag letters, argv without them) for a command line whose flags are all in
    OWN_FLAGS. Raises ValueError naming the first other flag."""
    i, letters = 1, ""
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-", "--"):
        a = argv[i]
        if a.startswith(("-c", "-m")):
            break
        if not set(a[1:]) <= OWN_FLAGS:
            raise ValueError(f"flag {a}"[:64])
        letters += a[1:]
        i += 1
    if i < len(argv) and argv[i] == "--":
        raise ValueError("flag --")
    return letters, [argv[0], *argv[i:]]
