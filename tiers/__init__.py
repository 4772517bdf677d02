"""Engine-agnostic storage: chunk KV store, disk tier, codecs, placement. Never imports sglang."""
