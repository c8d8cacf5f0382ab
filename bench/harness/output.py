"""Results: JSON written atomically with the machine, date and command recorded; read back gzipped
or not (bench/results keeps its raw files as .json.gz); fixed-width tables; matplotlib if present."""

from __future__ import annotations

import datetime
import gzip
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any


def provenance(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Where and when a result was measured, and by which command (`python -m MODULE ARGS` when the
    benchmark was run as a module)."""
    args = list(sys.argv if argv is None else argv)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    command = " ".join(["python -m", spec.name, *args[1:]] if spec is not None else args)
    return {
        "host": os.uname().nodename,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "argv": args,
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def write_json(
    path: Path | str,
    data: Any,
    *,
    indent: int | None = 1,
    meta: bool = True,
    default: Callable[[Any], Any] | None = None,
) -> Path:
    """Replace `path` atomically (a temporary file, then a rename) with `data` as JSON; a dict gets
    a "provenance" key (provenance()) unless it has one or `meta` is False; gzipped when the name
    ends in .gz. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if meta and isinstance(data, dict) and "provenance" not in data:
        data = {**data, "provenance": provenance()}
    text = json.dumps(data, indent=indent, default=default)
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".gz":
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        tmp.write_text(text)
    tmp.replace(path)
    return path


def read_text(path: Path | str) -> str:
    """A results file's text, gunzipped when it is gzip (by its magic, whatever its name)."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return raw.decode("utf-8")


def read_json(path: Path | str) -> Any:
    """A results file, gzipped or not. Raises OSError or ValueError."""
    return json.loads(read_text(path))


def results_stem(path: Path | str) -> str:
    """A results file's name without .gz and .json: what its plots and logs are named after."""
    name = Path(path).name
    for ext in (".gz", ".json"):
        name = name.removesuffix(ext)
    return name


def table(
    header: Sequence[str] | None,
    rows: Sequence[Sequence[Any]],
    *,
    floatfmt: str = ".3f",
    first_width: int | None = None,
    sep: str = " ",
    left: bool = False,
) -> str:
    """Rows under a header (none when None), the first column left-aligned, the others
    right-aligned (left too with `left`), each as wide as its widest cell, joined by `sep`; floats
    formatted by `floatfmt`, None as '-'."""

    def cell(x: Any) -> str:
        if x is None:
            return "-"
        return format(x, floatfmt) if isinstance(x, float) else str(x)

    cells = [[cell(x) for x in r] for r in ([header] if header is not None else []) + list(rows)]
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(max(map(len, cells)))]
    if first_width is not None:
        widths[0] = max(widths[0], first_width)
    return "\n".join(
        sep.join(
            c.ljust(widths[i]) if i == 0 or left else c.rjust(widths[i]) for i, c in enumerate(r)
        ).rstrip()
        for r in cells
    )


def pyplot() -> Any:
    """matplotlib.pyplot with the Agg backend, or None where matplotlib is not importable (plots are
    optional: `pip install -e '.[bench]'`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


class Progress:
    """One stderr line, rewritten in place while a pass runs (plain lines when not a terminal)."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.failed, self.running = label, total, 0, 0, 0
        self.t0 = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def show(self, final: bool = False) -> None:
        now = time.monotonic()
        if not final and not self.tty and now - self._last < 10.0:
            return
        self._last = now
        width = 24
        fill = int(width * self.done / max(1, self.total))
        msg = (
            f"[{self.label:<8}] |{'#' * fill}{'.' * (width - fill)}| {self.done}/{self.total} cmds "
            f"{self.running} running {self.failed} failed {now - self.t0:6.1f}s"
        )
        end = "\n" if final or not self.tty else ""
        sys.stderr.write(("\r" if self.tty else "") + msg + end)
        sys.stderr.flush()


def module_prog(spec: ModuleSpec | None) -> str:
    """argparse's prog for a benchmark run as `python -m bench.NAME` (its usage line says so)."""
    return f"python -m {spec.name}" if spec is not None else Path(sys.argv[0]).name
