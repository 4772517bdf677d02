"""Group TTL optimisation for the disk tier (Kareto §4.3, Algorithm 2) and its trace replay.

`python -m sglang_hicache_ext.tuning.ttl replay ...` runs the replay CLI (see `sglang_hicache_ext.tuning.ttl.cli`).
"""
