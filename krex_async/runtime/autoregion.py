"""KREX_AUTO_REGION=1: wrap known timing loops in krex regions as their modules get imported.

An entry at the front of sys.meta_path watches for the modules given hooks (`after_import`: the
modules in TARGETS here, torch.cuda for cudagate.py). It finds their real spec through the other
finders and wraps only the loader's exec_module, so that right after the module's own code runs,
krex_async.integrations.wrap_module() patches it (before any `from triton.testing import do_bench`
binds the name). Nothing is imported here ahead of the program: a program that never imports
triton or torch pays one dict lookup per import.

krex_async itself is found on sys.path, or else beside this runtime directory (appended to the
end of sys.path, so it never shadows the program's modules). A failure to patch leaves the module
as it was and is kept in `errors`; it is never raised into the import.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

TARGETS = ("triton.testing", "torch.utils.benchmark.utils.timer", "kernelbench.timing")
errors: list[str] = []
_HERE = os.path.dirname(os.path.abspath(__file__))


def _integrations() -> Any:
    try:
        import krex_async.integrations as integrations
    except ImportError:
        root = os.path.dirname(os.path.dirname(_HERE))
        if root not in sys.path:
            sys.path.append(root)
        import krex_async.integrations as integrations
    return integrations


def _patch(name: str, module: Any) -> None:
    try:
        _integrations().wrap_module(name, module)
    except Exception as e:  # noqa: BLE001
        errors.append(f"{name}: {type(e).__name__}: {e}")


# ---------------------------------------------------------------------------- after-import hooks

_hooks: dict[str, dict[str, Callable[[Any], None]]] = {}  # module -> key -> hook


def after_import(name: str, hook: Callable[[Any], None], key: str) -> None:
    """Call hook(module) right after module `name`'s own code has run, or at once where it is
    imported already; once per (name, key). Also used by cudagate.py (torch.cuda). A hook that
    raises is kept in `errors`, never raised into the import."""
    if key in _hooks.get(name, {}):
        return
    _hooks.setdefault(name, {})[key] = hook
    if name in sys.modules:
        _run(name, hook, sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _run(name: str, hook: Callable[[Any], None], module: Any) -> None:
    try:
        hook(module)
    except Exception as e:  # noqa: BLE001
        errors.append(f"{name}: {type(e).__name__}: {e}")


class _Loader:
    """The real loader, with the hooks run after its exec_module; everything else delegated."""

    def __init__(self, inner: Any, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        for hook in list(_hooks.get(self._name, {}).values()):
            _run(self._name, hook, module)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


class _Finder:
    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in _hooks or name in self._busy:
            return None
        self._busy.add(name)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _Loader(spec.loader, name)  # type: ignore[assignment]
                    return spec
            return None
        finally:
            self._busy.discard(name)


def install() -> None:
    """Patch the targets already imported and watch for the others (idempotent)."""
    for name in TARGETS:
        after_import(name, functools.partial(_patch, name), key="auto-region")
