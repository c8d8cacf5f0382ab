"""What an ended command costs the daemon while its result is kept (--retention): its report and
the tails an attach returns, not its stdin (up to 8 MiB) nor its environment."""

from __future__ import annotations

from krex_async import protocol as P

from ..conftest import run_daemon
from ..security.helpers import rss_kib

N = 24


async def test_ended_commands_with_8_mib_stdin_do_not_keep_it():
    stdin = b"s" * P.MAX_STDIN
    env = {"PATH": "/usr/bin:/bin", "BIG": "e" * 65536}
    async with run_daemon("--isolation", "signal", "--retention", "600") as d:
        async with await d.client() as c:
            for _ in range(3):  # the allocator's and the frame buffers' steady state
                await c.run(["true"], stdin=stdin, env=env)
            before = rss_kib(d.proc.pid)
            ids = []
            for _ in range(N):
                res = await c.run(["wc", "-c"], stdin=stdin, env=env)
                assert res.stdout.split() == [str(len(stdin)).encode()], res.stdout
                ids.append(res.report.command)
            grown_mib = (rss_kib(d.proc.pid) - before) / 1024
            # Every result is still there for its agent: report and output tail.
            again = await (await c.attach(ids[0])).wait()
            assert again.report.argv == ["wc", "-c"] and again.stdout.strip() == str(len(stdin)).encode()
    # Keeping the stdin would be N x 8 MiB (192 MiB); a report and two small tails are KiBs.
    print(f"rss growth {grown_mib:.2f} MiB")
    assert grown_mib < N * 8 / 8, f"daemon RSS grew {grown_mib:.1f} MiB over {N} ended commands"
