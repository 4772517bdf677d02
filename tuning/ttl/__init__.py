"""Group TTL optimisation for the disk tier (Kareto §4.3, Algorithm 2) and its trace replay.

`python -m tuning.ttl replay ...` runs the replay CLI (see `tuning.ttl.cli`).
"""
