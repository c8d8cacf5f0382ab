"""The client side: `Client` (submit.py) for agents submitting commands, `region()` (region.py) for the
code inside a command, and the stdin feeder the CLI uses (stdinfeed.py). Public names are re-exported
by `krex_async` itself."""
