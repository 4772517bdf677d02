"""Engine-agnostic tree logic: subtree grouping, access recording, chunk index. Never imports sglang."""
