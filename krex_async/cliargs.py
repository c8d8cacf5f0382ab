"""argparse value types the command-line modules share (cli.py, statusview.py): one home, so the
status view need not import the CLI that imports it."""

from __future__ import annotations

import argparse


def seconds(text: str) -> float:
    """argparse type for a duration: a number of seconds >= 0 (said plainly, not by the protocol)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, a number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds, a number >= 0, got {text!r}")
    return value
