"""A GPU neighbour for bench/gpu/check_drain.py (run as a krex command: the runtime on PYTHONPATH).

    sibling.py load    queue seconds of matmuls, then keep ~`backlog` of them in flight forever
    sibling.py verify  launch a long exact chain (permutation matmuls and a counter), printing
                       "launched" halfway (queue full), then synchronise and check: OK or BAD

The load loop polls its events with sleeps so that the krex runtime's signal lands promptly.
"""

import sys
import time
from collections.abc import Callable

import torch


def load(size: int = 16384, per_batch: int = 50, batches_in_flight: int = 2) -> None:
    a = torch.randn(size, size, device="cuda", dtype=torch.float16)
    out = torch.empty_like(a)
    pending = []
    print("ready", flush=True)
    while True:
        for _ in range(per_batch):
            torch.matmul(a, a, out=out)
        ev = torch.cuda.Event()
        ev.record()
        pending.append(ev)
        while len(pending) > batches_in_flight:
            while not pending[0].query():
                time.sleep(0.001)
            pending.pop(0)


def verify(steps: int = 2000, n: int = 4096) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(-100, 100, (n, n), generator=gen).float()
    perm = torch.randperm(n, generator=gen)
    p = torch.eye(n)[perm]
    q = p.argmax(dim=0)  # (b @ p)[:, j] == b[:, q[j]]: exact in fp32 (one nonzero term)
    cols = torch.arange(n)
    for _ in range(steps):
        cols = cols[q]
    expected = a[:, cols]
    b, pg = a.cuda(), p.cuda()
    counter = torch.zeros(1 << 16, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        if i == steps // 2:  # the launch queue is full by now: about a thousand kernels in flight
            print("launched", flush=True)
        b = b @ pg
        counter.add_(1.0)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    ok = torch.equal(b.cpu(), expected) and bool((counter == steps).all())
    print(f"{'OK' if ok else 'BAD'} steps={steps} total_s={total:.3f}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    modes: dict[str, Callable[[], None]] = {"load": load, "verify": verify}
    modes[sys.argv[1]]()
