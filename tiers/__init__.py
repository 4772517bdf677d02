"""Engine-agnostic storage: the page tier (pages/), the chunk tiers (chunks/). No sglang."""
