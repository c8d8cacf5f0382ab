"""Linux plumbing every layer shares: /proc and mount-table reading (procfs.py), spawning processes as
another user (spawn.py), sd_notify (sdnotify.py), small file helpers (fsutil.py). Imports nothing of krex."""
