"""The device's clock around a region's grant: wait for a clock the power cap held down to come
back (--settle-ms) and say how long the owner should warm the device before timing (warm_ms)."""

from __future__ import annotations

import asyncio
import time

from krex_async.daemon.model.core import Core, Region


class Clock:
    def __init__(self, core: Core) -> None:
        self.core = core

    async def warm(self) -> None:
        """Read each GPU's clock once, on the executor `settle` uses: its thread and the vendor
        library's first query of the device (5-20 ms on the H200) are paid at start-up, not by
        the first region's entry."""
        node = self.core.node
        if node is None:
            return
        loop = asyncio.get_running_loop()
        for dev in self.core.devices:
            if dev.vendor != "cpu":
                await loop.run_in_executor(None, node.clock, dev)

    async def settle(self, r: Region) -> None:
        """Wait (up to --settle-ms) for a GPU clock held down by the power cap to come back.

        A neighbour's large matmuls leave the SM clock low for about 100 ms after they stop, and a
        short kernel timed then runs slow; once the clock is back near its target it times as alone
        (bench/gpu/check_settle.py). A clock low because the device idles comes back with the
        owner's own work: no waiting for it."""
        node = self.core.node
        dev = self.core.device(r.device)
        if node is None or dev.vendor == "cpu":
            return
        t0 = time.perf_counter()
        deadline = t0 + self.core.config.settle_ms / 1000
        loop = asyncio.get_running_loop()
        st = await loop.run_in_executor(None, node.clock, dev)  # NVML calls: not on the loop
        fraction = self.core.config.settle_fraction
        while st is not None and not st.settled(fraction) and not st.idle and time.perf_counter() < deadline:
            await asyncio.sleep(0.002)
            st = await loop.run_in_executor(None, node.clock, dev) or st
        r.clock = st
        if st is not None:
            r.report.settle_s = time.perf_counter() - t0
            r.report.clock_mhz, r.report.clock_target_mhz = st.sm_mhz, st.target_mhz

    def warm_ms(self, r: Region) -> float:
        """What the region asked for, else --warm-ms, else what the clock needs: nothing when it
        has settled at its target, 20 ms when it idles low (the owner's work raises it within
        milliseconds), and 200 ms where it cannot be read (a short kernel timed right after a
        neighbour was quiesced runs slow without warming: bench/gpu/check_drain.py). The cpu
        device has no clock state to warm."""
        if r.request.warm_ms >= 0:
            return r.request.warm_ms
        if self.core.config.warm_ms >= 0:
            return self.core.config.warm_ms
        if self.core.device(r.device).vendor == "cpu":
            return 0.0
        if r.clock is None:
            return 200.0
        return 0.0 if r.clock.settled(self.core.config.settle_fraction) else 20.0
