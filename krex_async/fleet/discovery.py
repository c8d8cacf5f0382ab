"""When the fleet client's refresher asks Ray for its nodes (FleetClient.discover: ray.nodes(), one
GCS call listing every node the cluster ever had): pure logic, testable without Ray.

Every `every` refreshes, to find nodes that joined. Sooner while a known node has no agent (its
agent or its node died), so a node back under its name is used again soon: 1, 2, 4, ... refreshes
after the last ask, at most `every`. A node removed for good stays agentless, and Ray cannot say
whether a node of that name will come back (a restarted host joins as a new Ray node), so it is
asked about at the regular pace, never at every refresh as before. The steps start again from 1
when another node loses its agent, or when every node has one again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class DiscoverPace:
    every: int = 10  # refreshes between asks while every node has its agent
    gap: int = 1  # refreshes from the last ask to the next, while a node has none
    last: int = 0  # the refresh of the last ask
    missing: frozenset[str] = field(default_factory=frozenset)  # nodes without an agent at it

    def due(self, tick: int, missing: Iterable[str]) -> bool:
        """Whether refresh number `tick` asks Ray, given the nodes that have no agent now."""
        now = frozenset(missing)
        if now - self.missing or not now:  # a node lost its agent since, or none has lost it
            self.gap = 1
        self.missing = now
        if tick - self.last < (min(self.gap, self.every) if now else self.every):
            return False
        self.last = tick
        if now:
            self.gap = min(self.gap * 2, self.every)
        return True
