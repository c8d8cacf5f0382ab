"""bench/jobs_time.py: the replay that bounds what a warm pool could give a pass."""

from __future__ import annotations

import pytest

from bench import jobs_time


def test_fifo_makespan_runs_jobs_in_order_on_the_first_free_slot() -> None:
    assert jobs_time.fifo_makespan([4.0, 1.0, 1.0, 3.0], 2) == pytest.approx(5.0)  # 1+1+3 on one slot
    assert jobs_time.fifo_makespan([4.0, 1.0, 1.0, 3.0], 1) == pytest.approx(9.0)
    assert jobs_time.fifo_makespan([], 8) == 0.0


def _job(submit: float, wall: float, imp: float, inputs: float) -> dict[str, object]:
    return {
        "submit_s": submit,
        "krex": {"wall_s": wall},
        "lines": [{"phases_s": {"import": imp, "inputs": inputs}}],
    }


def test_time_budget_sums_phases_and_replays_without_imports() -> None:
    # a long job submitted third waits for a slot: with imports gone it starts earlier
    recs = [_job(0.0, 5.0, 3.0, 1.0), _job(0.1, 5.0, 3.0, 1.0), _job(0.2, 10.0, 3.0, 6.0)]
    b = jobs_time.time_budget(recs, 2)
    assert b["phases_s"] == {"import": 9.0, "inputs": 8.0}
    assert b["outside_s"] == pytest.approx(20.0 - 17.0) and b["wall_s"] == 20.0
    assert b["replayed_s"] == pytest.approx(15.0) and b["without_import_s"] == pytest.approx(9.0)
    assert jobs_time.time_budget([*recs, {"submit_s": 1.0, "krex": {}}], 2) == {}  # one never ran


def test_report_lines_bound_only_the_passes_without_a_pool() -> None:
    recs = [_job(0.0, 5.0, 3.0, 1.0), _job(0.1, 5.0, 3.0, 1.0)]
    b = jobs_time.time_budget(recs, 2)
    variants = {
        "shared": {"time": b, "pooled": 0, "makespan_s": 5.0},
        "shared-pool": {"time": b, "pooled": 2, "makespan_s": 2.0},
    }
    text = "\n".join(jobs_time.lines(variants, 2))
    assert "shared: makespan 5.0 s measured, 5.0 replayed, 2.0 without imports (2.50x" in text
    assert "shared-pool: makespan" not in text
