"""Who may use each device when: the scheduler's pure logic, with no processes, sockets or clocks.

Per device it keeps the commands placed there and two FIFOs:

- policy ``region``: region requests. The head of the queue *holds* the device from the moment it is
  first in line (the daemon then isolates it and grants it) until it is released; the next is promoted.
- policy ``command``: command starts. A command holds its device from start to end; regions inside it
  are granted at once because the device is already theirs.
- policy ``shared``: nothing waits; regions are granted at once and only recorded.

Every method returns what the daemon must now do (which waiters are promoted). The daemon owns all the
mechanisms; this module only decides order, which is what makes it testable on its own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum


class Policy(StrEnum):
    """What a device's exclusivity covers (the module docstring); its value is how the command line,
    the config file, the wire and the records spell it."""

    REGION = "region"
    COMMAND = "command"
    SHARED = "shared"


@dataclass
class DeviceQueue:
    key: str
    commands: set[str] = field(default_factory=set)  # placed here and not yet ended
    holder: str | None = None  # region id (policy region) or command id (policy command)
    waiting: deque[str] = field(default_factory=deque)


class SchedulerError(Exception):
    pass


class Scheduler:
    def __init__(self, policy: Policy | str, devices: list[str]) -> None:
        self.policy = Policy(policy)
        self.devices = {key: DeviceQueue(key) for key in devices}
        self._region_device: dict[str, str] = {}
        self._region_command: dict[str, str] = {}

    def _dev(self, key: str) -> DeviceQueue:
        try:
            return self.devices[key]
        except KeyError:
            raise SchedulerError(f"unknown device {key!r}") from None

    # --------------------------------------------------------------------------------- commands

    def add_command(self, command: str, device: str | None) -> bool:
        """Place a command. Returns True if it may start now, False if it waits for its device."""
        if device is None:
            return True
        dev = self._dev(device)
        dev.commands.add(command)
        if self.policy is not Policy.COMMAND:
            return True
        if dev.holder is None:
            dev.holder = command
            return True
        dev.waiting.append(command)
        return False

    def end_command(self, command: str, device: str | None) -> list[str]:
        """A command ended (or was cancelled while waiting). Returns commands that may start now."""
        if device is None:
            return []
        dev = self._dev(device)
        dev.commands.discard(command)
        if self.policy is not Policy.COMMAND:
            return []
        if command in dev.waiting:
            dev.waiting.remove(command)
            return []
        if dev.holder != command:
            return []
        dev.holder = dev.waiting.popleft() if dev.waiting else None
        return [dev.holder] if dev.holder else []

    def siblings(self, device: str, command: str) -> list[str]:
        """The other commands placed on the device, in a stable order."""
        return sorted(c for c in self._dev(device).commands if c != command)

    # ---------------------------------------------------------------------------------- regions

    def isolates(self) -> bool:
        """Whether regions are exclusive under this policy (only `region`)."""
        return self.policy is Policy.REGION

    def request_region(self, region: str, command: str, device: str) -> bool:
        """Queue a region. Returns True if it holds the device now (or needs no turn)."""
        dev = self._dev(device)
        if region in self._region_device:
            raise SchedulerError(f"region {region} already requested")
        self._region_device[region] = device
        self._region_command[region] = command
        if self.policy is not Policy.REGION:
            return True
        if dev.holder is None:
            dev.holder = region
            return True
        dev.waiting.append(region)
        return False

    def release_region(self, region: str) -> str | None:
        """A region ended, or its request was withdrawn. Returns the region promoted to holder."""
        device = self._region_device.pop(region, None)
        self._region_command.pop(region, None)
        if device is None or self.policy is not Policy.REGION:
            return None
        dev = self.devices[device]
        if region in dev.waiting:
            dev.waiting.remove(region)
            return None
        if dev.holder != region:
            return None
        dev.holder = dev.waiting.popleft() if dev.waiting else None
        return dev.holder

    def holder(self, device: str) -> str | None:
        return self._dev(device).holder

    def queued(self, device: str) -> list[str]:
        return list(self._dev(device).waiting)

    def regions_of(self, command: str) -> list[str]:
        return [r for r, c in self._region_command.items() if c == command]
