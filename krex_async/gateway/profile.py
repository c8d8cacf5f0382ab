"""`profile` jobs: ncu (or rocprofv3) around one call of the candidate, with the reference
gateway's request semantics and result shape.

    request: level survey|sol|deep (deep needs kernel_regex), profiler ncu|rocprofv3 (default: the
             first installed), counters (ncu --metrics / rocprofv3 --pmc), kernel_regex, top_kernels
    job:     ncu --profile-from-start off ... python profile_driver.py: the driver builds the
             candidate for one shape (ATREX_PROFILE_SHAPE_ID, else the first), warms it up
             (ATREX_PROFILE_WARMUP, default 3) and profiles one call between cudaProfilerStart and
             cudaProfilerStop, inside a krex region when it runs under krex
    result:  {profiler, level, kernels: [{name, duration (ns), duration_unit, compute_sol_pct,
             mem_sol_pct, dram_pct, occupancy_pct, bound, [diagnostics and ncu's rules for deep],
             metrics}],
             [note]} sorted by duration, cut to top_kernels

Where no profiler is installed the kind is not offered (501 kind_not_supported, saying so).
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

from krex_async.gateway import limits as L
from krex_async.gateway.files import find, read_job_file, write_files
from krex_async.gateway.kinds import Eval, _bundle, _materialize
from krex_async.gateway.store import error

LEVELS = ("survey", "sol", "deep")
TOOLS = ("ncu", "rocprofv3")
MAX_COUNTERS = 256
MAX_CSV = 256 * L.MiB
SOL_METRICS = (
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
)
NS_PER = {
    u: f
    for f, units in (
        (1e9, ("s", "second", "seconds")),
        (1e6, ("ms", "msecond", "millisecond", "milliseconds")),
        (1e3, ("us", "usecond", "microsecond", "microseconds")),
    )
    for u in units
}  # anything else (ns, nsecond) is already ns

DRIVER = '''\
"""krex gateway profile driver: one candidate call, between cudaProfilerStart and Stop."""
import contextlib, json, os, sys
from pathlib import Path

job, bench_src = Path(sys.argv[1]), sys.argv[2]
try:
    from atrex_bench.eval import _runtime as rt
except ImportError:
    sys.path.insert(0, bench_src)
    from atrex_bench.eval import _runtime as rt
import torch

ref = job / "reference" / "reference.py"
shapes = [str(k) for k in json.loads((job / "reference" / "shapes.json").read_text())]
shape_id = os.environ.get("ATREX_PROFILE_SHAPE_ID") or min(
    shapes, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))
dev = torch.device("cuda")
ref_mod = rt.import_module_from_path(ref, "krex_profile_reference")
rt.validate_reference_module(ref_mod)
inputs = rt.resolve_input_module(ref, ref_mod, module_prefix="krex_profile_input")
shape = rt.load_shape_spec(ref, shape_id)
model = rt.instantiate_model_module(job / "candidate.py", dev, "krex_profile_candidate",
                                    init_inputs=rt.load_shape_init_inputs(shape, dev)).model
call = rt.load_shape_call_inputs(inputs, shape, dev)


@contextlib.contextmanager
def exclusive():
    """Under krex, the profiled call has the device to itself (a region); where the region cannot
    be had (no krex package, the daemon's socket out of reach) it runs anyway, saying so."""
    if not os.environ.get("KREX_COMMAND"):
        yield
        return
    try:
        from krex_async import region
        held = region("profile")
        held.__enter__()
    except Exception as e:  # ImportError, OSError, RegionError: profile without the region
        print(f"krex profile driver: no region ({e}); profiling without one", file=sys.stderr)
        yield
        return
    try:
        yield
    finally:
        held.__exit__(None, None, None)


def once():
    a = rt.clone_model_inputs(call)
    model(*a.args, **a.kwargs)


with torch.inference_mode():
    for _ in range(int(os.environ.get("ATREX_PROFILE_WARMUP", "3"))):
        once()
    rt.sync_device(dev)
    with exclusive():
        torch.cuda.cudart().cudaProfilerStart()
        try:
            once()
            rt.sync_device(dev)
        finally:
            torch.cuda.cudart().cudaProfilerStop()
'''


def find_tool(name: str) -> str | None:
    """PATH, then $NCU_BIN / $ROCPROFV3_BIN, then the toolkits' usual homes."""
    found = shutil.which(name)
    if found:
        return found
    env = os.environ.get("NCU_BIN" if name == "ncu" else "ROCPROFV3_BIN")
    homes = [Path(env)] if env else []
    if name == "ncu":
        homes += [
            Path("/usr/local/cuda/bin/ncu"),
            *sorted(Path("/usr/local").glob("cuda-*/bin/ncu"), reverse=True),
        ]
    else:
        homes += [Path("/opt/rocm/bin/rocprofv3"), Path("/usr/bin/rocprofv3")]
    return next((str(p) for p in homes if p.is_file() and os.access(p, os.X_OK)), None)


def find_profilers() -> tuple[dict[str, str], str]:
    """({tool: path} for the installed profilers, why there is none)."""
    tools = {t: p for t in TOOLS if (p := find_tool(t))}
    return tools, "" if tools else (
        "no profiler: ncu is not on PATH, $NCU_BIN or /usr/local/cuda*/bin, and rocprofv3 is not installed"
    )


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        v = float(str(value).strip().replace(",", "").replace("%", ""))
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def _is_duration(metric: str) -> bool:
    """gpu__time_duration.* under --metrics; "Duration" (GPU Speed Of Light) under --set."""
    return metric.startswith("gpu__time_duration") or metric == "Duration"


def parse_ncu(text: str, level: str, top: int | None) -> dict[str, Any]:
    """ncu's --csv log: one row per (kernel launch, metric); kernels keyed by name.

    Under `--set full` (level deep) the header gains the rule columns (Rule Name ... Estimated
    Speedup) and the metric rows stop after Metric Value: rows are read up to the columns they
    have (the reference gateway drops every such row and so returns no kernel for a deep profile),
    and the rule rows become the kernel's `rules` (krex's addition: ncu's own advice)."""
    rows = list(csv.reader(io.StringIO(text)))
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r and "Metric Name" in r), None)
    out: dict[str, Any] = {"profiler": "ncu", "level": level, "kernels": []}
    if start is None:
        out["note"] = "no kernels captured by ncu"
        return out
    header = [c.strip() for c in rows[start]]
    need = header.index("Metric Value") + 1 if "Metric Value" in header else len(header)
    samples: dict[str, dict[str, list[float]]] = {}
    durations: dict[str, float] = {}
    units: dict[str, dict[str, str]] = {}
    rules: dict[str, dict[tuple[str, str], dict[str, Any]]] = {}
    for raw in rows[start + 1 :]:
        if len(raw) < need:
            continue
        rec = dict(zip(header, raw))
        name, metric = rec.get("Kernel Name", "").strip(), rec.get("Metric Name", "").strip()
        rule = rec.get("Rule Name", "").strip()
        if name and rule and not metric:
            said = rec.get("Rule Description", "").strip()
            rules.setdefault(name, {})[(rule, said)] = {
                "name": rule,
                "type": rec.get("Rule Type", "").strip(),
                "description": said,
                "estimated_speedup": _number(rec.get("Estimated Speedup")),
                "estimated_speedup_type": rec.get("Estimated Speedup Type", "").strip() or None,
            }
            continue
        value = _number(rec.get("Metric Value"))
        if not name or not metric or value is None:
            continue
        unit = rec.get("Metric Unit", "").strip()
        seen = units.setdefault(name, {})
        if seen.setdefault(metric, unit) != unit:  # --set names two metrics alike ("Memory
            metric = f"{metric} [{unit}]"  # Throughput" in % and in byte/second): keep both
            seen.setdefault(metric, unit)
        samples.setdefault(name, {}).setdefault(metric, []).append(value)
        durations.setdefault(name, 0.0)
        if _is_duration(metric):
            durations[name] += value * NS_PER.get(unit.lower().replace(" ", ""), 1.0)
    kernels = []
    for name, metrics in samples.items():

        def mean(raw: str, shown: str) -> float | None:
            """A raw metric (--metrics) or its display name in percent (--set)."""
            for m, vs in metrics.items():  # noqa: B023 - called in this iteration only
                if m.startswith(raw) or (m == shown and units[name].get(m) == "%"):  # noqa: B023
                    return sum(vs) / len(vs)
            return None

        k: dict[str, Any] = {"name": name, "duration": durations[name], "duration_unit": "ns"}
        if level != "survey":
            compute = mean("sm__throughput", "Compute (SM) Throughput")
            memory = mean("gpu__compute_memory_throughput", "Memory Throughput")
            k.update(
                compute_sol_pct=compute,
                mem_sol_pct=memory,
                dram_pct=mean("dram__throughput", "DRAM Throughput"),
                occupancy_pct=mean("sm__warps_active", "Achieved Occupancy"),
                bound="compute" if (compute or 0.0) >= (memory or 0.0) else "memory",
            )
        if level == "deep":
            k["diagnostics"] = {m: str(vs[-1]) for m, vs in metrics.items() if not _is_duration(m)}
            k["rules"] = list(rules.get(name, {}).values())
        k["metrics"] = {m: vs[-1] for m, vs in metrics.items()}
        kernels.append(k)
    kernels.sort(key=lambda k: k["duration"], reverse=True)
    out["kernels"] = kernels[:top] if top is not None else kernels
    if not out["kernels"]:
        out["note"] = "no kernels captured by ncu"
    return out


def parse_rocprof(tables: list[str], level: str, top: int | None) -> dict[str, Any]:
    """rocprofv3's kernel-trace CSVs: durations (or end - start) summed per kernel name."""
    kernels: dict[str, dict[str, Any]] = {}
    skip = {"Duration", "Start_Timestamp", "Start_Timestamp_ns", "End_Timestamp", "End_Timestamp_ns"}
    for text in tables:
        for row in csv.DictReader(io.StringIO(text)):
            name = next(
                (
                    str(row.get(f) or "").strip()
                    for f in ("Kernel_Name", "Kernel Name", "Name")
                    if str(row.get(f) or "").strip()
                ),
                "",
            )
            if not name:
                continue
            k = kernels.setdefault(
                name, {"name": name, "duration": 0.0, "duration_unit": "ns", "metrics": {}}
            )
            d = _number(row.get("Duration"))
            if d is None:
                s = _number(row.get("Start_Timestamp") or row.get("Start_Timestamp_ns"))
                e = _number(row.get("End_Timestamp") or row.get("End_Timestamp_ns"))
                d = e - s if s is not None and e is not None else 0.0
            k["duration"] += max(0.0, d)
            k["metrics"].update(
                {f: n for f, v in row.items() if f not in skip and (n := _number(v)) is not None}
            )
    ranked = sorted(kernels.values(), key=lambda k: k["duration"], reverse=True)
    out: dict[str, Any] = {
        "profiler": "rocprofv3",
        "level": level,
        "kernels": ranked[:top] if top is not None else ranked,
    }
    if not out["kernels"]:
        out["note"] = "no kernels captured by rocprofv3"
    return out


class Profile(Eval):
    """One candidate call under the profiler; the result parsed from its CSV."""

    def __init__(
        self, lim: L.Limits, accepted: frozenset[str], runner: Path, python: str, tools: dict[str, str]
    ) -> None:
        super().__init__(lim, accepted, runner, python)
        self.tools = tools
        self.bench_src = str(runner.parent.parent / "src")

    def validate(self, payload: Any) -> tuple[dict[str, Any], str | None, str | None]:
        p = L.obj(payload)
        req = _bundle(p, self.lim, self.accepted)
        level = p.get("level", "sol")
        if level not in LEVELS:
            raise L.Invalid("invalid_level", f"level must be one of: {', '.join(LEVELS)}")
        tool = p.get("profiler")
        if tool is not None and tool not in TOOLS:
            raise L.Invalid("invalid_profiler", "profiler must be 'ncu' or 'rocprofv3'")
        counters = p.get("counters") or []
        if (
            not isinstance(counters, list)
            or len(counters) > MAX_COUNTERS
            or not all(isinstance(c, str) and c.strip() and len(c) <= 512 for c in counters)
        ):
            raise L.Invalid(
                "invalid_counters", f"counters must be an array of at most {MAX_COUNTERS} non-empty strings"
            )
        regex = p.get("kernel_regex")
        if regex is not None:
            if not isinstance(regex, str) or not regex or len(regex) > 1024:
                raise L.Invalid(
                    "invalid_kernel_regex",
                    "kernel_regex must be a non-empty string of at most 1024 characters",
                )
            try:
                re.compile(regex)
            except re.error as e:
                raise L.Invalid("invalid_kernel_regex", f"kernel_regex is invalid: {e}") from None
        if level == "deep" and not regex:
            raise L.Invalid("invalid_level", "level='deep' requires kernel_regex")
        top = p.get("top_kernels")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= 1000):
            raise L.Invalid("invalid_top_kernels", "top_kernels must be an integer in 1..1000")
        req.update(
            mode=None, level=level, profiler=tool, counters=counters, kernel_regex=regex, top_kernels=top
        )
        author = p.get("author")
        return req, L.idempotency_key(p), author if isinstance(author, str) else None

    def prepare(self, request: dict[str, Any], workdir: Path) -> tuple[list[str], float]:
        _materialize(request, workdir)
        write_files(workdir, {"profile_driver.py": DRIVER})
        (workdir / "profile_output").mkdir(mode=0o700)
        tool = request.get("profiler") or next(iter(self.tools))
        exe = self.tools.get(tool)
        if exe is None:
            raise FileNotFoundError(f"requested profiler {tool!r} is not installed here")
        driver = [self.python, str(workdir / "profile_driver.py"), str(workdir), self.bench_src]
        counters, regex = request.get("counters") or [], request.get("kernel_regex")
        out = workdir / "profile_output"
        if tool == "ncu":
            argv = [
                exe,
                "--csv",
                "--log-file",
                str(out / "ncu.csv"),
                "--profile-from-start",
                "off",
                "--target-processes",
                "all",
                "--kernel-name-base",
                "demangled",
            ]
            if counters:
                argv += ["--metrics", ",".join(counters)]
            elif request["level"] == "deep":
                argv += ["--set", "full"]
            else:
                argv += [
                    "--metrics",
                    ",".join(SOL_METRICS[:1] if request["level"] == "survey" else SOL_METRICS),
                ]
            if regex:
                argv += ["--kernel-name", f"regex:{regex}"]
            return argv + driver, float(request["timeout_s"])
        argv = [exe, "--kernel-trace", "--output-format", "csv", "-d", str(out)]
        if counters:
            argv += ["--pmc", *counters]
        if regex:
            argv += ["--kernel-include-regex", regex]
        return argv + ["--"] + driver, float(request["timeout_s"])

    def complete(
        self, request: dict[str, Any], workdir: Path, result: dict[str, Any], owner: int | None
    ) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
        if result["exit_code"] != 0:
            return (
                "failed",
                result,
                error("profiler_failed", f"profiler exited with status {result['exit_code']}"),
            )
        level, top = request["level"], request.get("top_kernels")
        tool = request.get("profiler") or next(iter(self.tools))
        try:
            if tool == "ncu":
                text = read_job_file(workdir, "profile_output/ncu.csv", owner, MAX_CSV)
                parsed = parse_ncu(text.decode("utf-8", "replace"), level, top)
            else:
                parsed = parse_rocprof(
                    [
                        read_job_file(workdir, rel, owner, MAX_CSV).decode("utf-8", "replace")
                        for rel in find(workdir, "profile_output", suffix=".csv")
                    ],
                    level,
                    top,
                )
        except OSError as e:  # no CSV at all: the reference fails the job the same way
            return "failed", result, error("execution_error", f"{type(e).__name__}: {e}")
        parsed["krex"] = {"regions": result["regions"], **result["krex"]}
        return "succeeded", parsed, None
