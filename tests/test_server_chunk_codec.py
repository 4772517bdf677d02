"""Chunks stored compressed (POST /chunks "codec", setting chunk_codec) in a real server: the
listing shows each chunk's codec, the disk holds the compressed form, a fused request answers
alike from host memory and, after a restart, from the compressed files; a damaged compressed
layer is never decoded into attention (the request gets the normal prefill); bad codecs are a
400, a codec change of a stored chunk a 409."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import requests

from sglang_hicache_ext.sglang_ext.server.launcher import running_server
from sglang_hicache_ext.tiers.chunks.stored_forms import read_header
from tests.test_server_mooncake import _normal
from tests.test_server_restart import DAMAGED, DOCUMENTS, PROMPT, _chunks, _fused, small_server

pytestmark = pytest.mark.server


def _register(url: str, **body: object) -> requests.Response:
    return requests.post(url + "/chunks", json=body, timeout=120)


def _flush(url: str) -> None:
    """Drop the tree's cached prefixes (a prompt served before is a prefix hit, not fused)."""
    requests.post(url + "/flush_cache", timeout=30).raise_for_status()


def test_compressed_chunks_across_a_restart(tiny_llama_path: Path, tmp_path: Path) -> None:
    settings = {"chunk_disk_dir": str(tmp_path / "disk"), "chunk_codec": "int8"}
    config = small_server(tiny_llama_path, tmp_path, settings)
    with running_server(config, log_path=tmp_path / "first.log"):
        for codec, message in [
            ("zstd", "unknown codec 'zstd'; stored chunks take int8 or int4"),
            ("knorm:1.5", "the drop ratio must be in (0, 1), got 1.5"),
            ("knorm:0", "the drop ratio must be in (0, 1), got 0"),
            ("knorm:0.5", "'knorm:0.5' drops tokens"),
            (8, '"codec" must be a string ("int8", "int4") or null'),
        ]:
            refused = _register(config.url, text=DOCUMENTS[0], codec=codec)
            assert refused.status_code == 400 and message in refused.json()["error"], refused.text
        assert _chunks(config.url)["chunks"] == []  # nothing was prefilled or stored
        ids = []
        for document, codec in zip(DOCUMENTS, ("int8", "int4", None), strict=True):
            # The last one takes the setting chunk_codec ("int8").
            body = {"text": document} | ({} if codec is None else {"codec": codec})
            created = _register(config.url, **body)
            assert created.status_code == 200, created.text
            info = created.json()
            assert (info["created"], info["codec"], info["tiers"]) == (
                True,
                codec or "int8",
                ["host", "disk"],
            )
            ids.append(info["id"])
        dense = _register(config.url, text=DAMAGED, codec=None).json()
        assert dense["codec"] is None
        again = _register(config.url, text=DOCUMENTS[0])
        assert again.status_code == 200 and again.json()["created"] is False
        changed = _register(config.url, text=DOCUMENTS[0], codec="int4")
        assert changed.status_code == 409 and "stored with codec 'int8'" in changed.json()["error"]
        files = {p.stem: read_header(p) for p in (tmp_path / "disk").rglob("*.chunk")}
        assert {key: files[key].codec for key in ids} == dict(
            zip(ids, ("int8", "int4", "int8"), strict=True)
        )
        for key, limit in zip(ids, (0.6, 0.35, 0.6), strict=True):  # KV in bf16 on this server
            header = files[key]
            assert header.stored_bytes < limit * header.num_layers * header.layer_bytes
        before, info = _fused(config.url, 0.15, PROMPT)
        assert info["fused"] and info["chunks_by_tier"] == {"host": 3}, info
        _flush(config.url)
        at_one, info = _fused(config.url, 1.0, PROMPT)
        assert info["fused"], info
        _flush(config.url)
        assert at_one == _normal(config.url, PROMPT)  # r = 1 recomputes every token
        normal_damaged = _normal(config.url, DAMAGED)
    # A bad sector in a compressed layer of the damaged chunk (stored int8 by a second request).
    with running_server(config, log_path=tmp_path / "second.log"):
        assert _register(config.url, text=DAMAGED, codec=None).json()["created"] is False
        requests.delete(config.url + f"/chunks/{dense['id']}", timeout=30).raise_for_status()
        damaged = _register(config.url, text=DAMAGED, codec="int8").json()
        assert damaged["codec"] == "int8"
    (path,) = (tmp_path / "disk").rglob(f"{damaged['id']}.chunk")
    header = read_header(path)
    assert header.compressed is not None
    layer = header.compressed.layers[1]
    with open(path, "r+b") as file:
        file.seek(header.data_offset + layer["offset"] + layer["length"] // 3)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0x04]))
    with running_server(config, log_path=tmp_path / "third.log"):
        listed = _chunks(config.url)
        assert {c["id"]: (c["codec"], c["tier"]) for c in listed["chunks"]} == {
            ids[0]: ("int8", "disk"),
            ids[1]: ("int4", "disk"),
            ids[2]: ("int8", "disk"),
            damaged["id"]: ("int8", "disk"),
        }
        after, info = _fused(config.url, 0.15, PROMPT)
        assert info["fused"] and info["chunks_by_tier"] == {"disk": 3}, info
        assert after == before  # the same rows as host memory held: decoded from the files
        load = info["load"]
        assert 0 < load["bytes_read"] < 0.6 * load["bytes_dense"], load
        output, info = _fused(config.url, 0.0, DAMAGED, fusion_selector="reuse")
        assert info == {"fused": False, "fallback": "chunk_unreadable"}, info
        assert output == normal_damaged
        listed = _chunks(config.url)
        assert damaged["id"] not in {c["id"] for c in listed["chunks"]}
        assert listed["stats"]["disk"]["corrupt_dropped"] == 1 and not path.exists()
        print(
            f"\nint8/int4 chunks on disk: fused from disk after a restart == from host memory: "
            f"{after == before}; read {load['bytes_read']} of {load['bytes_dense']} dense bytes; "
            "damaged compressed layer -> normal prefill"
        )
