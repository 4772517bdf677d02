"""Where each context's KV lives and how it is compressed, by one utility score (EvicPress)."""
