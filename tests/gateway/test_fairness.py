"""Fairness between identities (issue 36 item 6f): with --max-running 1, one identity's five
queued jobs do not make another identity's job wait for all five (identities are served in turn);
--max-running-per-identity keeps an identity's further jobs queued while another's start;
--max-queued-per-identity answers a submit beyond it with a clear 429."""

from __future__ import annotations

from pathlib import Path

from krex_async.gateway.client import GatewayClient
from krex_async.gateway.store import Store

from .conftest import gateway_home, stack

ALICE, BOB = "alice-fair-0123456789abcdef", "bob-fair-0123456789abcdef"


def tokens(home: Path) -> Path:
    path = home / "tokens"
    path.write_text(f"alice {ALICE}\nbob {BOB}\n")
    path.chmod(0o600)
    return path


async def test_one_identitys_queue_does_not_hold_up_another(tmp_path: Path) -> None:
    with gateway_home() as home:
        async with stack(tmp_path, "--token-file", str(tokens(home)), "--max-running", "1") as (_, gw, _c):
            async with GatewayClient(gw.url, ALICE) as a, GatewayClient(gw.url, BOB) as b:
                batch = [await a.dev(f"sleep 0.3; echo a{i}") for i in range(5)]
                mine = await b.dev("echo bob")
                done = await b.wait(mine["job_id"], 60)
                assert done["status"] == "succeeded" and done["result"]["stdout"] == "bob\n", done
                theirs = [await a.wait(j["job_id"], 60) for j in batch]
                assert all(j["status"] == "succeeded" for j in theirs), theirs
                started = sorted(theirs, key=lambda j: j["started_at"])
                # Bob's job runs right after the job of Alice's that was running when it came.
                assert done["started_at"] < started[2]["started_at"], (done, started)


async def test_per_identity_caps(tmp_path: Path) -> None:
    with gateway_home() as home:
        args = ("--token-file", str(tokens(home)), "--max-running", "2")
        caps = ("--max-running-per-identity", "1", "--max-queued-per-identity", "3")
        async with stack(tmp_path, *args, *caps) as (_, gw, _c):
            async with GatewayClient(gw.url, ALICE) as a, GatewayClient(gw.url, BOB) as b:
                gate = gw.scratch / "go"
                hold = f"while [ ! -e {gate} ]; do sleep 0.05; done"
                first = await a.dev(hold)
                second = await a.dev("echo a2")
                third = await a.dev("echo a3")
                status, body = await a.request("POST", "/v1/jobs/dev", json=a.dev_request("echo a4"))
                assert (status, body["reason"]) == (429, "too_many_jobs"), (status, body)
                assert "--max-queued-per-identity 3" in body["message"], body
                assert body["details"] == {"queued": 2, "running": 1, "limit": 3}, body
                # Bob's job runs beside Alice's first while her others wait for it, saying why.
                done = await b.wait((await b.dev("echo bob"))["job_id"], 60)
                assert done["result"]["stdout"] == "bob\n", done
                view = await a.get(second["job_id"])
                assert view["status"] == "queued", view
                assert "--max-running-per-identity" in view.get("waiting", ""), view
                gate.touch()
                for j in (first, second, third):
                    assert (await a.wait(j["job_id"], 60))["status"] == "succeeded"
                again = await a.dev("echo a5")  # under the cap again
                assert (await a.wait(again["job_id"], 60))["result"]["stdout"] == "a5\n"


def test_claims_alternate_between_identities(tmp_path: Path) -> None:
    store = Store(tmp_path / "jobs.db")
    try:
        ids = {}
        for owner, n in (("a", 4), ("b", 2), ("c", 1)):
            for i in range(n):
                job, _ = store.create("dev", {"command": f"{owner}{i}"}, "t", None, None, owner)
                ids[job["job_id"]] = owner
        order = []
        while (claimed := store.claim()) is not None:
            order.append(ids[claimed[0]])
            store.finish(claimed[0], "succeeded", {}, None)
        assert order == ["a", "b", "c", "a", "b", "a", "a"], order
    finally:
        store.close()
