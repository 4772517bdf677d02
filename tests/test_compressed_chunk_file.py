"""The stored form of a compressed chunk: every codec round-trips through it layer by layer,
and a damaged byte is found before anything is decompressed."""

from __future__ import annotations

import pytest
import torch

from sglang_hicache_ext.tiers.chunks.codecs.parse import parse_codec
from sglang_hicache_ext.tiers.chunks.compressed_file import (
    decode_layer,
    encode_compressed,
    parse_compressed_header,
)
from sglang_hicache_ext.tiers.chunks.header import CorruptChunkError
from tests.test_chunk_disk import make_chunk

SPECS = ["int8", "int4", "knorm:0.5", "keydiff:0.3", "snapkv:0.7"]


def _queries(layer: int) -> torch.Tensor:
    return torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(layer))


@pytest.mark.parametrize("spec", SPECS)
def test_every_codec_round_trips_layer_by_layer(spec: str) -> None:
    chunk = make_chunk(3, tokens=70)
    codec = parse_codec(spec)
    data = encode_compressed(chunk.content_hash, chunk, codec, _queries)
    header = parse_compressed_header(data, "c")
    assert (header.key, header.codec, header.token_ids) == (
        chunk.content_hash,
        spec,
        chunk.token_ids,
    )
    assert torch.equal(header.freq_scores, chunk.freq_scores)
    for layer, (keys, values) in enumerate(zip(chunk.keys, chunk.values, strict=True)):
        expected = codec.decode(codec.encode(keys, values, _queries(layer)))
        got = decode_layer(data, header, layer)
        assert torch.equal(got.keys, expected.keys) and torch.equal(got.values, expected.values)
        assert (got.kept is None) == (expected.kept is None)
        if got.kept is not None:
            assert torch.equal(got.kept, expected.kept)
    dense = sum(
        k.numel() * 4 + v.numel() * 4 for k, v in zip(chunk.keys, chunk.values, strict=True)
    )
    assert len(data) < dense


def test_a_damaged_layer_is_refused_and_the_others_still_decode() -> None:
    chunk = make_chunk(4, tokens=64)
    data = bytearray(encode_compressed(chunk.content_hash, chunk, parse_codec("int8")))
    header = parse_compressed_header(bytes(data), "c")
    middle = header.data_offset + header.layers[1]["offset"] + header.layers[1]["length"] // 2
    data[middle] ^= 0x01
    with pytest.raises(CorruptChunkError, match="layer 1: checksum mismatch"):
        decode_layer(bytes(data), header, 1)
    decode_layer(bytes(data), header, 0)  # the other layers are intact


@pytest.mark.parametrize("where", ["fixed", "metadata", "scores", "length"])
def test_a_damaged_header_is_refused(where: str) -> None:
    chunk = make_chunk(5, tokens=40)
    data = bytearray(encode_compressed(chunk.content_hash, chunk, parse_codec("int4")))
    header = parse_compressed_header(bytes(data), "c")
    if where == "length":
        data = data[:-1]
    else:
        offset = {"fixed": 0, "metadata": 20, "scores": header.data_offset - 3}[where]
        data[offset] ^= 0x40
    with pytest.raises(CorruptChunkError):
        parse_compressed_header(bytes(data), "c")
