"""A command's life: access checks, placement, memory admission and re-runs, launch (runner,
warm pools), the end (`lifecycle`), its report, and recovery after a daemon restart."""
