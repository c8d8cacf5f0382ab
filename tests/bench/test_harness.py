"""bench/harness: the one quantile implementation, results read back gzipped or not, and a real
daemon started and torn down on every path."""

from __future__ import annotations

import gzip
import socket
from pathlib import Path

import pytest

from bench.harness import output, stack, stats

from .conftest import run_script


def test_quantile_rules_are_the_ones_the_results_were_recorded_with() -> None:
    xs = [float(x) for x in range(10, 0, -1)]  # 1..10, unsorted
    assert stats.quantile(xs, 0.95, "linear") == pytest.approx(9.55)
    assert stats.quantile(xs, 0.95, "rank") == 10.0  # index int(9.5) = 9
    assert stats.quantile(xs, 0.5, "rank") == 6.0  # index 5: the upper median
    assert stats.quantile(xs, 0.5, "round") == 5.0  # index round(4.5) = 4 (to even)
    assert stats.quantile(xs, 0.95, "round") == 10.0  # index round(8.55) = 9
    # check_lock's nearest rank, index round(q*n + 0.5) - 1: ceil(q*n) - 1 except at odd q*n
    assert stats.quantile(xs, 0.2, "nearest") == 2.0  # round(2.5) = 2
    assert stats.quantile(xs, 0.3, "nearest") == 4.0  # round(3.5) = 4
    assert stats.quantile(xs, 0.25, "nearest") == 3.0  # round(3.0) = 3
    assert stats.pct([], 0.5) is None and stats.pct_or_nan([], 0.5) != stats.pct_or_nan([], 0.5)
    for bad in ((xs, 1.5), ([], 0.5)):
        with pytest.raises(ValueError):
            stats.quantile(*bad)


def test_results_written_with_provenance_and_read_back_gzipped_or_not(tmp_path: Path) -> None:
    plain = output.write_json(tmp_path / "r.json", {"x": [1, 2]})
    packed = output.write_json(tmp_path / "r.json.gz", {"x": [1, 2]})
    assert gzip.decompress(packed.read_bytes()).startswith(b"{")
    for p in (plain, packed):
        data = output.read_json(p)
        assert data["x"] == [1, 2]
        assert {"host", "date", "argv", "command", "machine"} <= set(data["provenance"])
    assert not list(tmp_path.glob("*.tmp"))
    assert output.results_stem(packed) == output.results_stem(plain) == "r"
    # a gzipped file read by the analysis as any other (the recorded jobs run, compressed in git)
    root = Path(__file__).resolve().parents[2]
    p = run_script("-m", "bench.jobs_report", str(root / "bench" / "results" / "h200-jobs-s9.json.gz"))
    assert "25.2" in p.stdout and "goals (issues 21-23):" in p.stdout


def test_table_aligns_columns_and_prints_none_as_a_dash() -> None:
    t = output.table(["name", "n", "p50"], [["a", 3, 0.5], ["longer", 12, None]])
    lines = t.splitlines()
    assert lines[0] == "name    n   p50"
    assert lines[1] == "a       3 0.500"
    assert lines[2] == "longer 12     -"
    # label and value, no header, left-aligned: the soak's table
    soak = output.table(None, [("agents", 64), ("s", "a b")], sep="  ", left=True)
    assert soak == "agents  64\ns       a b"


def _accepts(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(path)
            return True
        except OSError:
            return False


def test_daemon_starts_answers_and_leaves_nothing(tmp_path: Path) -> None:
    with stack.Daemon(["--devices", "cpu:1", "--probes", "off"], policy="region", parent=tmp_path) as d:
        assert _accepts(d.socket) and d.state_dir.is_dir()
    assert d.proc is not None and d.proc.returncode is not None
    assert list(tmp_path.iterdir()) == []
    # a daemon that refuses its arguments: RuntimeError with its log, nothing left behind
    with pytest.raises(RuntimeError, match="no-such-flag"):
        stack.Daemon(["--no-such-flag"], parent=tmp_path).start()
    assert list(tmp_path.iterdir()) == []


async def test_stack_serves_jobs_and_a_failed_start_leaves_no_directory(tmp_path: Path) -> None:
    # under /tmp: as root the jobs' user must pass through the stack's parent (tmp_path is 0700)
    logs = tmp_path / "logs"
    before = set(Path("/tmp").glob("krex-htest-*"))
    async with stack.Stack(
        ["--devices", "cpu:1", "--probes", "off"],
        2,
        policy="shared",
        logdir=logs,
        name="t",
        prefix="krex-htest-",
    ) as st:
        assert st.url.startswith("http://") and st.token
        async with st.client() as gw:
            job = await gw.dev("echo hi", timeout_s=60)
            view = await gw.wait(job["job_id"], 60)
        assert view["status"] == "succeeded" and "hi" in view["result"]["stdout"]
    assert (logs / "daemon-t.log").exists() and (logs / "gateway-t.log").exists()
    assert set(Path("/tmp").glob("krex-htest-*")) == before
    with pytest.raises(RuntimeError, match="no-such-flag"):
        async with stack.Stack(["--no-such-flag"], 1, logdir=logs, name="bad", prefix="krex-htest-"):
            pass
    assert set(Path("/tmp").glob("krex-htest-*")) == before


def test_a_daemon_left_running_is_stopped_when_the_benchmark_exits(tmp_path: Path) -> None:
    code = (
        "import sys\nfrom bench.harness.stack import Daemon\n"
        "d = Daemon(['--devices', 'cpu:1', '--probes', 'off'], parent=sys.argv[1]).start()\n"
        "print(d.proc.pid, flush=True)\nsys.exit(3)\n"
    )
    p = run_script("-c", code, str(tmp_path), check=False)
    assert p.returncode == 3, p.stderr
    pid = int(p.stdout.split()[0])
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z"), f"daemon {pid} still running ({state})"
    assert list(tmp_path.iterdir()) == []
