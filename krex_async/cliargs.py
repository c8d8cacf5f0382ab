"""argparse value types the command-line modules share (cli.py, statusview.py): one home, so the
status view need not import the CLI that imports it."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Collection


def seconds(text: str) -> float:
    """argparse type for a duration: a number of seconds >= 0 (said plainly, not by the protocol)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, a number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds, a number >= 0, got {text!r}")
    return value


def timeout(text: str) -> float:
    """argparse type for a time limit: seconds > 0 (0 would kill a command as it starts, where GNU
    timeout reads 0 as no limit; leaving the flag out is no limit). One message for every value
    it refuses (0, -1, abc): the same mistake reads the same."""
    try:
        value = seconds(text)
    except argparse.ArgumentTypeError:
        value = 0.0
    if value == 0:
        raise argparse.ArgumentTypeError(
            f"expected seconds > 0 (leave the flag out for no limit), got {text!r}"
        )
    return value


def interval(text: str) -> float:
    """argparse type for a redraw interval: seconds, at least 0.1 (0 would query in a tight loop)."""
    value = seconds(text)
    if value < 0.1:
        raise argparse.ArgumentTypeError(f"expected seconds, at least 0.1, got {text!r}")
    return value


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """argparse type: a whole number from lo to hi (argparse names the flag with the reason)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"{n} is not in {lo}..{hi}")
        return n

    return parse


def names_from(known: Collection[str]) -> Callable[[str], str]:
    """argparse type: a comma-separated list of some of `known` (given back as written); an unknown
    item is refused with the known ones listed, where it would otherwise match nothing silently."""

    def parse(text: str) -> str:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"none given (known: {', '.join(known)})")
        bad = [x for x in items if x not in known]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, bad))} (known: {', '.join(known)})"
            )
        return text

    return parse


def text_up_to(limit: int) -> Callable[[str], str]:
    """argparse type: text of at most `limit` characters (the protocol's bound, said by the flag)."""

    def parse(text: str) -> str:
        if len(text) > limit:
            raise argparse.ArgumentTypeError(f"{len(text)} characters, more than the {limit} allowed")
        return text

    return parse


def directory(text: str) -> str:
    """argparse type: a path that is an existing directory (a typo there would match nothing)."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"{text}: {'not a directory' if os.path.exists(text) else 'no such directory'}"
        )
    return text


RAY_ADDRESS_FORMS = "auto, HOST:PORT (the Ray head's GCS, e.g. 10.0.0.5:6379) or ray://HOST:PORT (Ray client)"


def ray_address(text: str) -> str:
    """argparse type for a Ray cluster address (--fleet, --address): checked for its form here,
    so a typo is a usage error at once rather than a gateway that waits on no cluster."""
    bad = argparse.ArgumentTypeError(f"{text!r} is not a Ray address; expected {RAY_ADDRESS_FORMS}")
    if text == "auto":
        return text
    rest = text.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or any(c.isspace() or c in "/[]@" for c in host):
        raise bad
    if ":" in host and not rest.startswith("["):  # a bare IPv6 address: its port is ambiguous
        raise bad
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise bad
    return text
