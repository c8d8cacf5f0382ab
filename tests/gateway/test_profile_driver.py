"""The profile driver profiles exactly one candidate call (after the warm-up, between
cudaProfilerStart and cudaProfilerStop, in a krex region), as the reference gateway's ncu wraps one
call and not the whole evaluator. torch and Atrex-Bench's runtime are stand-ins written here that
record what the driver does; ncu is a stand-in that runs its target."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

from tests.security.helpers import USER_PYTHONPATH

from .conftest import job_python, stack
from .test_atrex_compat import client_job, typed
from .test_kinds import install_tools

FAKE_TORCH = textwrap.dedent("""
    import contextlib, os
    def _log(what):
        with open(os.environ["DRIVER_LOG"], "a") as f:
            f.write(what + "\\n")
    class device:
        def __init__(self, name): self.name = name
    def inference_mode():
        return contextlib.nullcontext()
    class _Cudart:
        def cudaProfilerStart(self): _log("start")
        def cudaProfilerStop(self): _log("stop")
    class cuda:
        @staticmethod
        def cudart(): return _Cudart()
""")
FAKE_RUNTIME = textwrap.dedent("""
    import importlib.util, json, types
    from torch import _log
    def import_module_from_path(path, prefix):
        spec = importlib.util.spec_from_file_location(prefix, path)
        m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
    def validate_reference_module(m): pass
    def resolve_input_module(ref, ref_mod, module_prefix):
        return import_module_from_path(ref.parent / "input.py", module_prefix)
    def load_shape_spec(ref, shape_id):
        _log("shape " + shape_id)
        return json.loads((ref.parent / "shapes.json").read_text())[shape_id]
    def load_shape_init_inputs(shape, dev): return types.SimpleNamespace(args=(), kwargs={})
    def instantiate_model_module(path, dev, prefix, init_inputs):
        m = import_module_from_path(path, prefix)
        return types.SimpleNamespace(model=m.Model())
    def load_shape_call_inputs(inputs, shape, dev):
        return types.SimpleNamespace(args=(), kwargs=inputs._make_inputs(**shape))
    def clone_model_inputs(x): return types.SimpleNamespace(args=x.args, kwargs=dict(x.kwargs))
    def sync_device(dev): _log("sync")
""")
CANDIDATE = textwrap.dedent("""
    from torch import _log
    class Model:
        def __call__(self, **kw):
            _log("call " + json.dumps(kw, sort_keys=True))
    import json
""")
RUNNING_NCU = textwrap.dedent("""\
    #!{py}
    import os, subprocess, sys
    args, i = sys.argv[1:], 0
    while args[i].startswith("--"):
        i += 1 if args[i] == "--csv" else 2
    log = args[args.index("--log-file") + 1]
    rc = subprocess.call(args[i:])
    with open(log, "w") as f:
        f.write('"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\\n')
        f.write('"0","k","gpu__time_duration.sum","ns","5"\\n')
    sys.exit(rc)
""")


def fakes(root: Path) -> Path:
    """torch and atrex_bench.eval._runtime stand-ins under root/site."""
    site = root / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(FAKE_TORCH)
    pkg = site / "atrex_bench" / "eval"
    pkg.mkdir(parents=True)
    (site / "atrex_bench" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "_runtime.py").write_text(FAKE_RUNTIME)
    for d, _, _ in os.walk(root):
        os.chmod(d, 0o755)
    return site


async def test_one_candidate_call_is_profiled_inside_a_region(tmp_path: Path, gwhome: Path) -> None:
    scratch = gwhome / "scratch"
    bench, env = install_tools(scratch)
    ncu = Path(env["PATH"].split(os.pathsep)[0]) / "ncu"
    ncu.write_text(RUNNING_NCU.format(py=job_python()))
    site = fakes(scratch / "fakes")
    log = scratch / "driver.log"
    log.touch()
    log.chmod(0o666)
    async with stack(tmp_path, "--atrex-bench-root", str(bench), env=env) as (_, _gw, c):
        req = typed("profile", CANDIDATE, level="survey")
        req["reference"]["shapes"] = {"10": {"n": 10}, "2": {"n": 2}, "x": {"n": 0}}
        req["reference"]["input_py"] = "def _make_inputs(n): return {'n': n}\n"
        req["env_vars"] = {
            "PYTHONPATH": os.pathsep.join([str(site), USER_PYTHONPATH]),
            "DRIVER_LOG": str(log),
            "ATREX_PROFILE_WARMUP": "2",
        }
        job = await client_job(c, "profile", req)
        assert job["status"] == "succeeded", job
        events = log.read_text().splitlines()
        assert events == [
            "shape 2",
            'call {"n": 2}',
            'call {"n": 2}',
            "sync",
            "start",
            'call {"n": 2}',
            "sync",
            "stop",
        ], events
        (region,) = job["result"]["krex"]["regions"]
        assert region["name"] == "profile" and region["outcome"] == "released", region
        assert job["result"]["kernels"][0]["name"] == "k"

        log.write_text("")
        req["env_vars"]["ATREX_PROFILE_SHAPE_ID"] = "10"
        job = await client_job(c, "profile", req)
        assert job["status"] == "succeeded", job
        assert log.read_text().splitlines()[0] == "shape 10"
