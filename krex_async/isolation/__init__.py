"""Isolation backends: freeze, thaw and fence commands' processes (see base.py)."""
