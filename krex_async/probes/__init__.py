"""eBPF and tracefs probes on GPU driver activity (see base.py)."""
