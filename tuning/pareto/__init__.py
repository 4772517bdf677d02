"""Adaptive Pareto search over DRAM size, disk TTL and disk type, with the grid baseline."""
