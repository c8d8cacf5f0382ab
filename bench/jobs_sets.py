"""Job sets for bench/jobs.py: which jobs a run submits, built from the suites the user points at.

A job is (spec, files): the spec is what bench/workload/job.py reads (kind, key, device, sizes), the
files are what the gateway uploads beside it (job.py and its two modules, spec.json, the KernelBench
problem's source, bench/suites.py for Atrex operators). Jobs with the same key time the same kernel the
same way, so the alone pass times each key and a policy's jobs are judged against it. Nothing of the
suites is copied: problems are read from the checkout when a run starts.

Sizes (`--set`): tiny (tests, a quick look), default (fits the whole comparison in one 10-minute H200
call: 8 KernelBench problems x 2), large (24 x 2, for longer runs).
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import suites

HERE = Path(__file__).resolve().parent
JOB_SCRIPT = HERE / "workload" / "job.py"
JOB_MODULES = ("jobutil.py", "job_kb.py")  # uploaded beside job.py
# The harness's quantiles, uploaded beside them under a name no agent's module has: the job's
# medians and p95s come from the same implementation as every other figure.
STATS_MODULE = ("bench_stats.py", HERE / "harness" / "stats.py")


@dataclass(frozen=True)
class Size:
    problems: int  # distinct KernelBench problems (and Atrex operator shapes)
    copies: int  # jobs per problem
    triton: int  # Triton jobs on a GPU when no --triton is given and no suite is (else 0)
    cpu: int  # cpu stand-in jobs on the cpu device when no suite is given
    trials: int  # timed trials per job (KernelBench's harness: 100)
    level_weights: tuple[int, int, int] = (5, 2, 1)  # share of levels 1, 2, 3 among the problems


SIZES = {"tiny": Size(2, 1, 4, 4, 20), "default": Size(8, 2, 16, 8, 100), "large": Size(24, 2, 32, 24, 100)}

# Elements of the Triton job's scale_add (fp32: 8 bytes of traffic each): ~0.1-2 ms on an H200.
TRITON_SIZES = (1 << 26, 1 << 27, 1 << 28, 1 << 29)
# Elements of the cpu stand-in's kernel: ~0.1-1, 1-10 and >10 ms of pure Python.
CPU_SIZES = (2_000, 20_000, 150_000)


@dataclass
class Job:
    spec: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return str(self.spec["key"])


def pick_problems(
    probs: list[dict[str, Any]], n: int, weights: tuple[int, int, int], seed: int
) -> list[dict[str, Any]]:
    """n problems spread over the levels by `weights` (a level with too few gives its share to the
    others), each level's chosen by a seeded shuffle: the same checkout, size and seed pick the same."""
    by = {lv: [p for p in probs if p["problem"].startswith(f"level{lv}/")] for lv in (1, 2, 3)}
    rng = random.Random(seed)
    for lv in by:
        rng.shuffle(by[lv])
    quota = {lv: round(n * w / sum(weights)) for lv, w in zip((1, 2, 3), weights)}
    chosen: list[dict[str, Any]] = []
    for lv in (1, 2, 3):
        chosen += by[lv][: quota[lv]]
    rest = [p for lv in (1, 2, 3) for p in by[lv] if p not in chosen]
    return (chosen + rest)[:n]


def kernelbench_jobs(
    root: Path, size: Size, device: str, levels: list[int], seed: int, problems: int | None = None
) -> list[Job]:
    """KernelBench jobs: each problem's source uploaded as problem.py; the checkout's src/ (for
    kernelbench.timing) by path. Raises FileNotFoundError for a folder without KernelBench levels."""
    probs = pick_problems(
        suites.kernelbench_problems(root, levels), problems or size.problems, size.level_weights, seed
    )
    src = root / "src"
    jobs = []
    for p in probs:
        text = (Path(p["root"]) / p["path"]).read_text(encoding="utf-8")
        spec = {
            "kind": "kernelbench",
            "key": f"kb:{p['problem']}",
            "device": device,
            "problem": "problem.py",
            "kb_src": str(src.resolve()) if src.is_dir() else None,
            "method": "cuda_event" if device == "gpu" else "host_time",
            "warmup": 3,
            "trials": size.trials,
        }
        jobs += [Job(dict(spec), {"problem.py": text}) for _ in range(size.copies)]
    return jobs


def atrex_jobs(root: Path, size: Size, device: str, seed: int) -> list[Job]:
    """Atrex-Bench operator shapes, loaded in the job from the checkout by bench/suites.py."""
    probs = suites.atrex_problems(root)
    rng = random.Random(seed)
    rng.shuffle(probs)
    helper = (HERE / "suites.py").read_text(encoding="utf-8")
    jobs = []
    for p in probs[: size.problems]:
        spec = {
            "kind": "atrex",
            "key": f"atrex:{p['problem']}",
            "device": device,
            "source": p,
            "trials": size.trials,
            "seed": seed,
        }
        jobs += [Job(dict(spec), {"suites.py": helper}) for _ in range(size.copies)]
    return jobs


def triton_jobs(n: int) -> list[Job]:
    """n Triton do_bench jobs over TRITON_SIZES; each compiles its own kernel (fresh_tags)."""
    return [
        Job(
            {
                "kind": "triton",
                "key": f"triton:scale_add:n={TRITON_SIZES[i % len(TRITON_SIZES)]}",
                "device": "gpu",
                "n": TRITON_SIZES[i % len(TRITON_SIZES)],
            }
        )
        for i in range(n)
    ]


def cpu_jobs(n: int, trials: int) -> list[Job]:
    return [
        Job(
            {
                "kind": "cpu",
                "key": f"cpu:dot:n={CPU_SIZES[i % len(CPU_SIZES)]}",
                "device": "cpu",
                "n": CPU_SIZES[i % len(CPU_SIZES)],
                "trials": trials,
            }
        )
        for i in range(n)
    ]


def build(
    size: Size,
    device: str,
    kernelbench: Path | None,
    atrex: Path | None,
    triton: int | None,
    cpu: int | None,
    levels: list[int],
    seed: int,
    problems: int | None = None,
) -> list[Job]:
    """The whole set. Without any suite: Triton jobs on a GPU, cpu stand-ins on the cpu device."""
    jobs: list[Job] = []
    if kernelbench is not None:
        jobs += kernelbench_jobs(kernelbench, size, device, levels, seed, problems)
    if atrex is not None:
        jobs += atrex_jobs(atrex, size, device, seed)
    suite_given = kernelbench is not None or atrex is not None
    if device == "gpu":
        jobs += triton_jobs(triton if triton is not None else (0 if suite_given else size.triton))
    else:
        jobs += cpu_jobs(cpu if cpu is not None else (0 if suite_given else size.cpu), size.trials)
    if not jobs:
        raise ValueError("the job set is empty")
    return jobs


def fresh_tags(jobs: list[Job], label: str) -> list[Job]:
    """Copies with a tag unique to this pass and job: a Triton kernel's source (and cache key) differs
    in every job of every pass, so each compiles afresh as an agent's new kernel does."""
    run = uuid.uuid4().hex[:8]
    return [Job({**j.spec, "tag": f"{label}-{i}-{run}"}, j.files) for i, j in enumerate(jobs)]


def files_for(specs: list[dict[str, Any]], extra: list[dict[str, str]]) -> dict[str, str]:
    """job.py, spec.json (one spec, or {"batch": [...]}) and the jobs' own files. In a batch each
    problem gets its own file name, rewritten into its spec."""
    files = {"job.py": JOB_SCRIPT.read_text(encoding="utf-8")}
    for name in JOB_MODULES:
        files[name] = (JOB_SCRIPT.parent / name).read_text(encoding="utf-8")
    files[STATS_MODULE[0]] = STATS_MODULE[1].read_text(encoding="utf-8")
    out = []
    for i, (spec, own) in enumerate(zip(specs, extra)):
        spec = dict(spec)
        for name, text in own.items():
            if name == "problem.py" and len(specs) > 1:
                spec["problem"] = name = f"problem_{i}.py"
            files[name] = text
        out.append(spec)
    files["spec.json"] = json.dumps(out[0] if len(out) == 1 else {"batch": out})
    return files


def distinct(jobs: list[Job]) -> list[Job]:
    """The first job of each distinct key, in the set's order."""
    seen: dict[str, Job] = {}
    for j in jobs:
        seen.setdefault(j.key, j)
    return list(seen.values())


def alone_batches(jobs: list[Job]) -> list[list[Job]]:
    """One job per distinct key, grouped by device kind so each group runs in one process (the
    imports once, then each problem alone in turn)."""
    groups: dict[str, list[Job]] = {}
    for j in distinct(jobs):
        groups.setdefault("gpu" if j.spec.get("device") == "gpu" else j.spec["kind"], []).append(j)
    return list(groups.values())
