"""The region engine: a region's queue turn, entry (hold: lock or freeze, drain, core fence,
clock), the commands that join or exit while it is held, its release; `HoldSet` alone writes
what a region holds."""
