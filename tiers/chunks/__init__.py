"""Precomputed chunks in tiers: host memory, a local disk, a Mooncake Store; their file forms."""
