"""Checks and measurements that need the accelerator (run by bench/gpu/*.sh as python -m bench.gpu.NAME)."""
