"""Real kernel suites as trace sources: a KernelBench or an Atrex-Bench checkout the user points at.

Listing (`kernelbench_problems`, `atrex_problems`, `suite_kernels`) reads files and parses them with
`ast` only, so it needs neither torch nor a GPU and never runs suite code. Loading (`make_callable`)
runs inside an agent command: it imports the problem's files from the checkout, builds the model and
its inputs, and returns (fn, check). Nothing from either suite is copied into this repository.

- KernelBench: KernelBench/level{1,2,3}/*.py, each with `class Model`, `get_inputs()` and
  `get_init_inputs()`; `Model(*get_init_inputs())(*get_inputs())`.
- Atrex-Bench: data/<op>/ with reference.py (`class Model`), input.py (`_make_inputs(**input_kwargs)`
  returning a dict of call arguments) and shapes.json ({shape_id: {init_kwargs, input_kwargs}});
  `Model(**init_kwargs)(**_make_inputs(**input_kwargs))`.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def _names(path: Path) -> set[str]:
    """Top-level class and function names of a Python file (parsed, not run)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}


def kernelbench_problems(root: str | Path, levels: Sequence[int] = (1, 2, 3)) -> list[dict[str, Any]]:
    """Problems of a KernelBench checkout (root holds KernelBench/levelN/). Files without Model,
    get_inputs and get_init_inputs are skipped. Raises FileNotFoundError when no level folder exists."""
    base = Path(root) / "KernelBench"
    if not base.is_dir():
        base = Path(root)
    dirs = [base / f"level{n}" for n in levels if (base / f"level{n}").is_dir()]
    if not dirs:
        raise FileNotFoundError(f"no KernelBench/level{{{','.join(map(str, levels))}}} under {root}")
    out = []
    for d in dirs:
        for f in sorted(d.glob("*.py")):
            if {"Model", "get_inputs", "get_init_inputs"} <= _names(f):
                out.append(
                    {
                        "suite": "kernelbench",
                        "root": str(Path(root).resolve()),
                        "path": str(f.resolve().relative_to(Path(root).resolve())),
                        "problem": f"{d.name}/{f.stem}",
                        "shape": None,
                    }
                )
    return out


def atrex_problems(root: str | Path) -> list[dict[str, Any]]:
    """(operator, shape) problems of an Atrex-Bench checkout (root holds data/<op>/). An operator
    without reference.py, input.py and shapes.json is skipped. Raises FileNotFoundError without data/."""
    data = Path(root) / "data"
    if not data.is_dir():
        raise FileNotFoundError(f"no data/ folder under {root}")
    out = []
    for op in sorted(p for p in data.iterdir() if p.is_dir()):
        ref, inp, shp = op / "reference.py", op / "input.py", op / "shapes.json"
        if not (ref.is_file() and inp.is_file() and shp.is_file()) or "Model" not in _names(ref):
            continue
        if not {"_make_inputs", "get_inputs"} & _names(inp):
            continue
        for shape in json.loads(shp.read_text(encoding="utf-8")):
            out.append(
                {
                    "suite": "atrex",
                    "root": str(Path(root).resolve()),
                    "path": str(op.resolve().relative_to(Path(root).resolve())),
                    "problem": f"{op.name}#{shape}",
                    "shape": str(shape),
                }
            )
    return out


def suite_kernels(
    suite: str, root: str | Path, levels: Sequence[int] = (1, 2, 3), expected_ms: float = 1.0
) -> list[dict[str, Any]]:
    """Catalogue entries (trace `kernel` objects of kind "suite") for every problem of a checkout."""
    probs = kernelbench_problems(root, levels) if suite == "kernelbench" else atrex_problems(root)
    return [
        {
            "id": f"{'kb' if suite == 'kernelbench' else 'atrex'}:{p['problem']}",
            "kind": "suite",
            "source": p,
            "bucket": None,
            "expected_ms": expected_ms,
        }
        for p in probs
    ]


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _to_device(x: Any, gpu: bool) -> Any:
    """A tensor or module moved to the GPU (KREX_BENCH_TORCH_DEVICE overrides "cuda" for smoke tests)."""
    if gpu and hasattr(x, "to") and hasattr(x, "cuda"):
        return x.to(os.environ.get("KREX_BENCH_TORCH_DEVICE", "cuda"))
    return x


def _flat(x: Any) -> list[float]:
    """Numbers of an output (tensor, array, number, or nested lists/tuples/dicts of them)."""
    if hasattr(x, "detach"):
        return [float(v) for v in x.detach().double().flatten()[:4096].cpu().tolist()]
    if hasattr(x, "tolist") and not isinstance(x, (list, tuple)):
        return _flat(x.tolist())
    if isinstance(x, dict):
        return [v for k in sorted(x) for v in _flat(x[k])]
    if isinstance(x, (list, tuple)):
        return [v for e in x for v in _flat(e)]
    return [float(x)]


def make_callable(
    source: dict[str, Any], gpu: bool, seed: int
) -> tuple[Callable[[], Any], Callable[[], tuple[bool, float]]]:
    """(fn, check) for one suite problem, loaded from the user's checkout. check runs the reference
    twice on the same inputs and compares (a deterministic, finite reference is what an agent's
    candidate is checked against). Raises what the problem's own code raises."""
    root = Path(source["root"])
    if gpu:
        import torch

        torch.manual_seed(seed)
    if source["suite"] == "kernelbench":
        mod = _load(root / source["path"], f"kb_{abs(hash(source['path']))}")
        model = mod.Model(*mod.get_init_inputs())
        args = [_to_device(x, gpu) for x in mod.get_inputs()]
        kwargs: dict[Any, Any] = {}
    else:
        op = root / source["path"]
        shape = json.loads((op / "shapes.json").read_text(encoding="utf-8"))[source["shape"]]
        ref = _load(op / "reference.py", f"atrex_ref_{op.name}")
        inp = _load(op / "input.py", f"atrex_in_{op.name}")
        model = ref.Model(**shape.get("init_kwargs", {}))
        made = (
            inp._make_inputs(**shape.get("input_kwargs", {}))
            if hasattr(inp, "_make_inputs")
            else dict(enumerate(inp.get_inputs()))
        )
        args, kwargs = [], {k: _to_device(v, gpu) for k, v in made.items()}
        if all(isinstance(k, int) for k in kwargs):
            args, kwargs = [kwargs[k] for k in sorted(kwargs)], {}
    model = _to_device(model, gpu)
    if hasattr(model, "eval"):
        model = model.eval()

    if gpu:
        import torch

        def fn() -> Any:
            with torch.no_grad():
                return model(*args, **kwargs)
    else:

        def fn() -> Any:
            return model(*args, **kwargs)

    def check() -> tuple[bool, float]:
        a, b = _flat(fn()), _flat(fn())
        err = max((abs(p - q) for p, q in zip(a, b)), default=0.0)
        finite = all(math.isfinite(v) for v in a)
        return finite and len(a) == len(b) and err <= 1e-5 * max(1.0, max(map(abs, a), default=1.0)), err

    return fn, check
