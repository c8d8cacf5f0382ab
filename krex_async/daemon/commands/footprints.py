"""Peak device memory learned per key: what commands that need alike reached, kept across the
daemon's life in <state dir>/memory.json (admission.py takes a command's need from it).

A command's keys (`mem_keys`): its Submit.mem_key, else its label, else its program and first
argument. A mem_key of parts ("gateway dev / 3f2a") is a path, most general first: a command teaches
every prefix, and admission estimates it by the longest prefix known.
"""

from __future__ import annotations

import json
import os

from krex_async import logs
from krex_async import protocol as P
from krex_async.linux.fsutil import replace_file

log = logs.get("krex.daemon")

KEEP_PEAKS = 8  # peaks remembered per key: the need is the largest of them
KEEP_KEYS = 4096  # keys remembered (a daemon's life of distinct scripts must not grow the file)

KEY_SEP = " / "  # between a mem_key's parts, most general first


def mem_keys(spec: P.Submit) -> list[str]:
    """The keys a command learns under and is estimated by, most specific first: every prefix of a
    mem_key of parts, else the one key of `mem_key`."""
    if not spec.mem_key:
        return [mem_key(spec)]
    parts = [p.strip() for p in spec.mem_key.split(KEY_SEP.strip())]
    return [f"key {KEY_SEP.join(parts[:n])}" for n in range(len(parts), 0, -1)]


def mem_key(spec: P.Submit) -> str:
    """What commands that need alike share: the submit's mem_key, its label, else its program and
    first argument (`python bench.py`, `python -m pkg.mod`)."""
    if spec.mem_key:
        return mem_keys(spec)[0]
    if spec.label:
        return f"label {spec.label}"
    parts = [os.path.basename(spec.argv[0])]
    for i, arg in enumerate(spec.argv[1:], 1):
        if arg in ("-m", "-c") and i + 1 < len(spec.argv):  # python -m MODULE, sh -c TEXT
            parts += [arg, spec.argv[i + 1]]
            break
        if not arg.startswith("-"):
            parts.append(os.path.basename(arg))
            break
    return "argv " + " ".join(parts)[:256]


class Footprints:
    """Peak device memory by key, learned from commands that ended, kept in a JSON file."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.peaks: dict[str, list[int]] = {}
        if path is None:
            return
        try:
            with open(path) as f:
                raw = json.load(f)
            self.peaks = {
                str(k): [int(x) for x in v][-KEEP_PEAKS:] for k, v in raw.get("peaks", {}).items() if v
            }
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, AttributeError) as e:  # a damaged file: learn anew
            log.warning("footprints_unreadable", path=path, error=repr(e))

    def need(self, spec: P.Submit, default: int) -> tuple[int, str]:
        """(bytes, where the figure comes from) that a command of `spec` is taken to need: declared,
        learned, `default` (--mem-default) where above 0, else unknown (0)."""
        if spec.mem > 0:
            return spec.mem, "declared"
        for i, key in enumerate(mem_keys(spec)):
            # Its own key: the largest it reached. A prefix (its kind, never its own shape): the
            # kind's typical peak, not its largest: one outsize problem (29 GiB of an H100's 80 in
            # KernelBench's large set) reserved for every new shape held eight jobs to two or
            # three. A new shape larger than typical is seen as it grows (the peaks are sampled,
            # and what runs holds its peak) and, if it still meets an out-of-memory, is re-run.
            learned = self.get(key, typical=i > 0)
            if learned is not None:
                return learned, "learned"
        return (default, "default") if default > 0 else (0, "unknown")

    def get(self, key: str, typical: bool = False) -> int | None:
        """The largest of the key's recent peaks; `typical`: their median (a kind's many shapes)."""
        peaks = self.peaks.get(key)
        if not peaks:
            return None
        return sorted(peaks)[len(peaks) // 2] if typical else max(peaks)

    def learn(self, keys: list[str], peak: int) -> None:
        for key in keys:
            peaks = self.peaks.pop(key, [])  # re-inserted last: the least recently learned go first
            self.peaks[key] = [*peaks, peak][-KEEP_PEAKS:]
        while len(self.peaks) > KEEP_KEYS:
            del self.peaks[next(iter(self.peaks))]
        if self.path is not None:
            try:
                replace_file(self.path, json.dumps({"version": 1, "peaks": self.peaks}).encode())
            except OSError as e:
                log.warning("footprints_unwritable", path=self.path, error=repr(e))
