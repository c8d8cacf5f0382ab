"""Report import cycles among krex_async modules, and imports that run up the package's floors.

Why: a local import hides a circle from the interpreter but not from the design; this parses every
module with ast (function-local and TYPE_CHECKING imports included) so the check sees what a reader
sees. FLOORS says which top-level parts may use which: a module imports its own part and the floors
below it, never a floor above (the package's `__init__` is its public face and is left out). Exit
status 1 when any cycle or upward import exists, or a top-level part stands on no floor.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from pathlib import Path

PKG = "krex_async"

# Ground first. Each part may import its own modules and any part on a lower floor.
FLOORS = [
    {"linux", "protocol", "scheduler", "logs", "cliargs"},  # plumbing and the wire: no krex imports
    {"devices", "isolation", "integrations"},
    {"runtime"},  # loaded into commands' interpreters
    {"client", "probes", "ctxpool"},
    {"daemon"},  # `krex serve`
    {"ops"},  # doctor, cleanup, status, trace, demo
    {"fleet"},
    {"gateway"},
    {"cli", "__main__"},
]

# Inside the daemon (`krex serve`), the same rule one level down: its folders and its top-level
# modules (the wire: daemon, server, connection, listener, probing, startchecks) by floor.
DAEMON_FLOORS = [
    {"config", "persist"},  # the serve options; records and spool files on disk
    {"model"},  # Core, Command, Region and the HoldSet that alone writes what it holds, events
    {"regions"},  # the region engine
    {"commands"},  # a command's life: access, placement, admission, launch, end, report, recovery
    {"observe"},  # metrics, trace, attribution, timeline, status: subscribers to the model's events
    {"daemon", "server", "connection", "listener", "probing", "startchecks"},  # the wire, on top
]


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(current: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = current.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def edges(root: Path) -> dict[str, set[str]]:
    mods = {module_name(root, p): p for p in (root / PKG).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = resolve(mod, is_pkg, node)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                # the longest known module the target names (an attribute import names its module)
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != mod and not mod.startswith(t + "."):
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def part(mod: str) -> str:
    """The top-level part a module belongs to: krex_async.daemon.regions.engine -> daemon."""
    return mod.split(".")[1] if "." in mod else ""


def daemon_part(mod: str) -> str:
    """The daemon's folder or top-level module a module belongs to: krex_async.daemon.regions.entry ->
    regions; "" outside the daemon (and for the daemon package itself)."""
    bits = mod.split(".")
    return bits[2] if len(bits) > 2 and bits[1] == "daemon" else ""


def _up(
    graph: dict[str, set[str]], floors: list[set[str]], where: Callable[[str], str]
) -> tuple[list[tuple[str, str]], list[str]]:
    floor = {name: i for i, names in enumerate(floors) for name in names}
    unplaced = sorted({where(m) for m in graph if where(m) and where(m) not in floor})
    up = [
        (a, b)
        for a in sorted(graph)
        for b in sorted(graph[a])
        if where(a) in floor and where(b) in floor and floor[where(b)] > floor[where(a)]
    ]
    return up, unplaced


def upward(graph: dict[str, set[str]]) -> tuple[list[tuple[str, str]], list[str]]:
    """Imports from a lower floor to a higher one, and the parts that stand on no floor: the
    package's parts (FLOORS), then the daemon's folders (DAEMON_FLOORS)."""
    up, unplaced = _up(graph, FLOORS, part)
    inner_up, inner_unplaced = _up(graph, DAEMON_FLOORS, daemon_part)
    return up + inner_up, unplaced + [f"daemon.{name}" for name in inner_unplaced]


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent
    graph = edges(root)
    up, unplaced = upward(graph)
    for a, b in up:
        print(f"upward: {a} -> {b}")
    for name in unplaced:
        print(f"unplaced: {PKG}.{name} stands on no floor (add it to FLOORS in {Path(__file__).name})")
    found = cycles(graph)
    for comp in found:
        members = set(comp)
        print("cycle:", ", ".join(comp))
        for m in comp:
            for t in sorted(graph[m] & members):
                print(f"    {m} -> {t}")
    print(f"{len(found)} cycle(s) among {len(graph)} modules; {len(up)} upward import(s)")
    return 1 if found or up or unplaced else 0


if __name__ == "__main__":
    sys.exit(main())
