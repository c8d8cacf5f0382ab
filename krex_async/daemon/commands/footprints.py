"""Peak device memory learned per key: what commands that need alike reached, kept across the
daemon's life in <state dir>/memory.json (admission.py takes a command's need from it).

A command's keys (`mem_keys`): its Submit.mem_key, else its label, else its program and first
argument. A mem_key of parts ("gateway dev / 3f2a") is a path, most general first: a command teaches
every prefix, and admission estimates it by the longest prefix known.

A command may also name what it shares with others (Submit.mem_alike: the gateway gives a digest of
each of a job's files and of its command). Every earlier command that shared one of them bounds it:
a later candidate for the same problem shares the problem's files, not the candidate's. Such a
feature tells the command apart only where it is *specific*: taught by some of its key's recent
commands, not by all of them (a runner script every job carries is not; the file of one problem among
several is). The tightest bound of the specific features known is its need; with none known (a
problem not seen yet), its key's typical (median) peak: the key of many problems is a kind.

An out-of-memory's floor (what the failed command held and asked for: admission.learn_floor) is
learned for its problem, not its kind: under its features, and under floor_key (the digest of all
its features together, else its most specific key); a command of that very job whose floor is above
what `need` gives otherwise is taken at the floor.

Each user learns from its own commands alone (the user a command runs as): another user's commands
that share a label, a program name or a feature, by chance or to mislead, tell nothing of this
user's. A user past KEEP_KEYS of them does not push another's out: the user holding the most keys
gives up its oldest.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os

from krex_async import logs
from krex_async import protocol as P
from krex_async.linux.fsutil import replace_file

log = logs.get("krex.daemon")

KEEP_PEAKS = 8  # peaks remembered per key: the need is the largest of them
KEEP_KEYS = 4096  # keys remembered (a daemon's life of distinct scripts must not grow the file)
# memory.json is written at most this often: all of it each time (up to a few MB with KEEP_KEYS
# features), which on the daemon's loop at every command's end took 4-13 ms
WRITE_S = 2.0

KEY_SEP = " / "  # between a mem_key's parts, most general first
ALIKE = "alike "  # before a Submit.mem_alike feature, in the file
FLOOR = "floor "  # before the digest of a command's features, in the file: its problem's floors
VERSION = 3  # 3: keys per user ("u1000 label x"); a file before it is learned anew


def mem_keys(spec: P.Submit) -> list[str]:
    """The keys a command learns under and is estimated by, most specific first: every prefix of a
    mem_key of parts, else the one key of `mem_key`."""
    if not spec.mem_key:
        return [mem_key(spec)]
    parts = [p.strip() for p in spec.mem_key.split(KEY_SEP.strip())]
    return [f"key {KEY_SEP.join(parts[:n])}" for n in range(len(parts), 0, -1)]


def scoped(uid: int, keys: list[str]) -> list[str]:
    """`keys` as user `uid` has them in the file (footprints are per user)."""
    return [f"u{uid} {k}" for k in keys]


def _user(key: str) -> str:
    return key.split(" ", 1)[0]


def alike_keys(spec: P.Submit) -> list[str]:
    """The keys of what the command shares with others (Submit.mem_alike)."""
    return [ALIKE + a for a in spec.mem_alike]


def floor_key(spec: P.Submit) -> str:
    """The key a command's out-of-memory floors are kept under besides its features (admission's
    learn_floor): not its kind's keys. With features, all of them at once (this very job: a gateway
    job's key names a shape, which every problem of a set can share, and its features its problem's
    files and its candidate's), else its most specific key. Under its kind's keys, one problem that
    failed twice filled three of its kind's remembered peaks, whose median is the kind's typical
    need. Its features carry the floor to the problem's next candidate where one tells the problem
    apart; this key to the same job again where none does yet (a shape's first problem)."""
    if not spec.mem_alike:
        return mem_keys(spec)[0]
    return FLOOR + hashlib.sha256("\0".join(sorted(spec.mem_alike)).encode()).hexdigest()[:32]


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
    """Peak device memory by key, learned from commands that ended, kept in a JSON file. Each peak
    has its command's number (`seqs`, counted in `seq`): which commands taught a key."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.peaks: dict[str, list[int]] = {}
        self.seqs: dict[str, list[int]] = {}
        self.users: dict[str, dict[str, None]] = {}  # "u<uid>" -> its keys, least recently learned first
        self.seq = 0
        self._dirty = False  # learned since the file was written
        self._timer: asyncio.TimerHandle | None = None  # the write due within WRITE_S
        if path is None:
            return
        try:
            with open(path) as f:
                raw = json.load(f)
            if raw.get("version", 1) < VERSION:  # keys of no user: another user's could mislead
                log.warning("footprints_relearned", path=path, version=raw.get("version", 1))
                raw = {}
            self.peaks = {
                str(k): [int(x) for x in v][-KEEP_PEAKS:] for k, v in raw.get("peaks", {}).items() if v
            }
            seqs = raw.get("seqs", {})  # a peak without its number: 0, telling nothing
            self.seqs = {
                k: [int(x) for x in seqs.get(k, [0] * len(v))][-len(v) :] for k, v in self.peaks.items()
            }
            self.seq = int(raw.get("seq", 0))
            for k in self.peaks:
                self.users.setdefault(_user(k), {})[k] = None
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, AttributeError) as e:  # a damaged file: learn anew
            log.warning("footprints_unreadable", path=path, error=repr(e))
            self.peaks, self.seqs, self.users, self.seq = {}, {}, {}, 0

    def need(self, spec: P.Submit, uid: int, default: int) -> tuple[int, str]:
        """(bytes, where the figure comes from) that a command of `spec` run as `uid` is taken to
        need: declared, learned (what the user's commands of its own key, or sharing a specific
        feature, peaked at), typical (the median peak of its kind: a guess for what was not seen
        yet), `default` (--mem-default) where above 0, else unknown (0); learned where more, what
        an out-of-memory of its problem showed it needs at least (floor_key)."""
        if spec.mem > 0:
            return spec.mem, "declared"
        need, source = self._need(spec, uid, default)
        floor = self.get(scoped(uid, [floor_key(spec)])[0]) if spec.mem_alike else None
        return (floor, "learned") if floor is not None and floor > need else (need, source)

    def _need(self, spec: P.Submit, uid: int, default: int) -> tuple[int, str]:
        keys = scoped(uid, mem_keys(spec))
        bounds = [self.get(k) or 0 for k in scoped(uid, alike_keys(spec)) if self.specific(k, keys)]
        if bounds:  # every earlier command that shared it peaked within: the tightest is its need
            return min(bounds), "learned"
        for i, key in enumerate(keys):
            # Its own key: the largest it reached. A prefix (its kind, never its own shape), or its
            # own key where features tell its commands apart (the key of many problems): the
            # kind's typical peak, not its largest: one outsize problem (29 GiB of an H100's 80
            # in KernelBench's large set) reserved for every new shape held eight jobs to two or
            # three. A new shape larger than typical is seen as it grows (the peaks are sampled,
            # and what runs holds its peak) and, if it still meets an out-of-memory, is re-run.
            typical = i > 0 or bool(spec.mem_alike)
            learned = self.get(key, typical=typical)
            if learned is not None:
                return learned, "typical" if typical else "learned"
        return (default, "default") if default > 0 else (0, "unknown")

    def learn_floor(self, uid: int, spec: P.Submit, floor: int) -> None:
        """An out-of-memory of a command of `spec` run as `uid` showed it needs at least `floor`:
        learned under its features and floor_key, those of them not above it already (a feature
        keeps KEEP_PEAKS: eight floors of one batch of candidates would leave it none of the
        key's commands to be told specific by)."""
        keys = alike_keys(spec) + [floor_key(spec)]
        below = [k for k, mine in zip(keys, scoped(uid, keys)) if (self.get(mine) or 0) < floor]
        self.learn(uid, below, floor)

    def specific(self, feature: str, keys: list[str]) -> bool:
        """Whether the known `feature` tells some of the commands of its key (else of the longest
        known prefix) from the rest: not every one of those recent commands taught it (the file of
        one problem among several, not a script they all carry). Compared over what both remember
        (a feature taught by other keys' commands too remembers fewer of this key's); peaks without
        their numbers (0) tell nothing; with no key known, nothing is specific."""
        mine = [x for x in self.seqs.get(feature, []) if x]
        ref = next((k for k in keys if any(self.seqs.get(k, []))), None)
        if not mine or ref is None:
            return False
        theirs = [x for x in self.seqs[ref] if x]
        if len(self.seqs[feature]) == KEEP_PEAKS:  # it remembers no further back than its oldest
            theirs = [x for x in theirs if x >= min(mine)]
        return not set(theirs) <= set(mine)

    def get(self, key: str, typical: bool = False) -> int | None:
        """The largest of the key's recent peaks; `typical`: their median (a kind's many shapes)."""
        peaks = self.peaks.get(key)
        if not peaks:
            return None
        return sorted(peaks)[len(peaks) // 2] if typical else max(peaks)

    def learn(self, uid: int, keys: list[str], peak: int) -> None:
        """A command of `keys` run as `uid` peaked at `peak`. Give its alike_keys before its
        mem_keys: past KEEP_KEYS, the user holding the most keys gives up its least recently
        learned, so a command's own key outlives its features, and one user's many keys never push
        out another's fewer. The file is written within WRITE_S (at once where no event loop runs),
        and by flush()."""
        self.seq += 1
        me = f"u{uid}"
        mine = self.users.setdefault(me, {})
        for key in dict.fromkeys(scoped(uid, keys)):
            peaks = self.peaks.pop(key, [])  # re-inserted last: the least recently learned go first
            seqs = self.seqs.pop(key, [])
            self.peaks[key] = [*peaks, peak][-KEEP_PEAKS:]
            self.seqs[key] = [*seqs, self.seq][-KEEP_PEAKS:]
            mine.pop(key, None)
            mine[key] = None
        if not mine:  # no keys given
            del self.users[me]
        while len(self.peaks) > KEEP_KEYS:  # the most keys, the learning user's on a tie
            most = max(self.users, key=lambda u: (len(self.users[u]), u == me))
            held = self.users[most]
            oldest = next(iter(held))
            del held[oldest], self.peaks[oldest]
            self.seqs.pop(oldest, None)
            if not held:
                del self.users[most]
        self._dirty = True
        if self.path is None or self._timer is not None:
            return
        try:
            self._timer = asyncio.get_running_loop().call_later(WRITE_S, self.flush)
        except RuntimeError:  # no event loop (a tool, a test): now
            self.flush()

    def flush(self) -> None:
        """Write what was learned since the last write (the daemon's stop calls it)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._dirty or self.path is None:
            return
        self._dirty = False
        data = {"version": VERSION, "seq": self.seq, "peaks": self.peaks, "seqs": self.seqs}
        try:
            replace_file(self.path, json.dumps(data).encode())
        except OSError as e:
            log.warning("footprints_unwritable", path=self.path, error=repr(e))
