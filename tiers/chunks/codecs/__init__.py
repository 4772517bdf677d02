"""Codecs for chunk KV: quantisation (int8, int4) and token dropping (knorm, snapkv, keydiff)."""
