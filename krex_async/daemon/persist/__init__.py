"""What the daemon keeps on disk: command records and output spool files in the state dir."""
