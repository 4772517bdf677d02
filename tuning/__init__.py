"""Engine-agnostic optimisers and simulator. Never imports sglang."""
