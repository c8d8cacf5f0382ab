"""Child programs the benchmarks run: agent commands, region loops, the gateway job."""
