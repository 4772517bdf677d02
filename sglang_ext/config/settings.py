"""Extension settings: one pydantic model, strict, every default and bound written once.

Unknown keys and bad values raise `SettingsError` with the offending key and the allowed values,
so the server stops with one clear line instead of running with a typo silently ignored. The
per-request fusion options reuse its types. Where the values come from (a JSON or TOML file, or
SGLang's storage-backend extra-config) is `settings_sources.py`; the `disk_tier` part
(`DiskTierSettings`, `disk_tier_settings.py`) is read from the extra-config's own keys when that
loads our disk tier, since SGLang hands the backend nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from sglang_hicache_ext.sglang_ext.config.disk_tier_settings import (
    DiskTierSettings,
)
from sglang_hicache_ext.sglang_ext.config.extra_config import SettingsError
from sglang_hicache_ext.sglang_ext.config.fusion_settings import (
    DEFAULT_TARGET_AGREEMENT,
    FusionSettings,
)
from sglang_hicache_ext.sglang_ext.config.setting_types import (
    ChunkCodecSpec,
    HostPort,
    TierOrder,
)
from sglang_hicache_ext.sglang_ext.config.validation_messages import one_line

__all__ = ["DEFAULT_TARGET_AGREEMENT", "ExtensionSettings"]


class ExtensionSettings(FusionSettings):
    """What a user can set; every field has a sane default. The fusion defaults (`fusion_*`)
    are `FusionSettings`'; the chunk tiers, capture and admission, and the disk tier are here."""

    # strict: a TOML `1` is not `true`, `1.5` not an int; values come from files, not forms.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    cpu_compat: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Apply the CPU compatibility hooks (host-pool pinning, KV transfers, ...): "
        "auto applies them when torch has no CUDA device.",
    )
    preflight_checks: bool = Field(
        True, description="Check model path, port and settings before SGLang starts."
    )
    tree_core: Literal["python"] = Field(
        "python",
        description="Tree core of the hicache_ext radix cache. Our subclass overrides Python "
        "methods, so only the Python core honours them.",
    )
    report_in_server_info: bool = Field(
        True, description='Report extension state under internal_states[i]["hicache_ext"].'
    )
    chunk_store_bytes: int = Field(
        2 * 1024**3,
        gt=0,
        description="Host memory for precomputed chunk KV (POST /chunks), LRU beyond it "
        "(pieces kept by auto_chunks must also win their place: chunk_admission).",
    )
    chunk_tiers: TierOrder | None = Field(
        None,
        description="Tiers holding registered chunks, fastest first: host, disk, mooncake. "
        "Default: host, and disk when chunk_disk_dir is set.",
    )
    chunk_disk_dir: str | None = Field(
        None,
        description="Directory of the chunk disk tier (on when set): chunks are written through "
        "to it at registration, demoted to it from host memory, and found again after a "
        "restart. One server per directory; a subdirectory per model keeps models apart.",
    )
    chunk_disk_bytes: int = Field(
        64 * 1024**3, gt=0, description="Byte budget of the chunk disk tier, LRU beyond it."
    )
    chunk_disk_read_bytes_per_s: int = Field(
        0,
        ge=0,
        description="Cap on the chunk disk tier's read rate, to emulate a slower medium "
        "(benchmarks); 0 = the disk's own speed.",
        json_schema_extra={"zero_means": "the disk's own speed"},
    )
    chunk_mooncake_master: HostPort | None = Field(
        None,
        description="host:port of a Mooncake master: the chunk tier shared by servers (on "
        "when set). Chunks are written through to it; another server finds them by id.",
    )
    chunk_mooncake_metadata_server: str = Field(
        "P2PHANDSHAKE",
        min_length=1,
        description="Mooncake transfer metadata: P2PHANDSHAKE (none needed) or "
        "http://host:port/metadata.",
    )
    chunk_mooncake_local_hostname: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address other Mooncake clients reach this server's segment at.",
    )
    chunk_mooncake_segment_bytes: int = Field(
        512 * 1024**2,
        ge=0,
        description="Memory this server lends to the Mooncake store (its share of the shared "
        "tier; chunks in it go when the server stops).",
        json_schema_extra={"zero_means": "lends none, uses other servers' segments"},
    )
    chunk_mooncake_catalog: bool = Field(
        True,
        description="Announce every chunk this server stores in the Mooncake tier (registered "
        "or kept by auto_chunks) in the namespace's catalogue, and index the chunks other "
        "servers announce: a document captured on one server is reused on every other.",
    )
    chunk_codec: ChunkCodecSpec | None = Field(
        None,
        description='Codec every chunk tier (host memory included) stores chunks with: "int8" '
        'or "int4" (KIVI-style), decoded layer by layer as requests read them; POST /chunks '
        '"codec" overrides it per chunk. Default: dense rows.',
    )
    chunk_promote_on_read: bool = Field(
        True,
        description="Put a chunk read from disk or Mooncake into host memory (LRU); false keeps "
        "host memory to the chunks registered into it (a placement decides what it holds).",
    )
    chunk_placement_interval_s: float | None = Field(
        None,
        gt=0,
        description="Re-place chunks every this many seconds (needs chunk_disk_dir): probe "
        "each chunk's answers under each codec, then choose what host memory holds of it "
        "(dense, int8, int4 or nothing; the disk keeps its registered rows) by the utility "
        "(alpha * quality - TTFT) * frequency. Null: only when POST /hicache_ext/placement asks.",
    )
    chunk_placement_alpha: float = Field(
        20.0,
        ge=0,
        allow_inf_nan=False,
        description="Seconds of TTFT that one unit of answer quality is worth in the "
        'placement\'s utility (POST /hicache_ext/placement "alpha" overrides it).',
    )
    chunk_placement_quality_floor: float = Field(
        0.9,
        ge=0,
        le=1,
        description="The placement never keeps a chunk in a form whose probed answers score "
        "below this token F1 against its registered rows' answers.",
    )
    chunk_prefix: str | None = Field(
        None,
        max_length=64 * 1024,
        description='Text every chunk registered without a "prefix" is computed after: the '
        "deployment's system prompt and chat header, as its prompts start (null: chunks are "
        "computed alone).",
    )
    chunk_max_body_bytes: int = Field(
        4 * 1024**2, gt=0, description="Largest POST /chunks body, checked before parsing."
    )
    chunk_max_tokens: int = Field(
        32768,
        gt=0,
        description="Largest chunk in tokens (also never more than the context length).",
    )
    chunk_registrations_per_minute: int = Field(
        120,
        ge=0,
        description="POST /chunks requests per minute and client host.",
        json_schema_extra={"zero_means": "unlimited"},
    )

    # On: measured as close to the full prefill as chunks registered after the prefix, and a
    # copy of rows per new document (docs/auto-chunks.md); only prompts that ask for fusion are
    # captured, so a server where nobody fuses keeps nothing.
    auto_chunks: bool = Field(
        True,
        description="Reuse documents from ordinary traffic: the paragraphs of every prompt that "
        "asks for fusion (custom_params.fusion, or fusion_by_default) are kept as chunks from "
        "the rows its own prefill computed (radix/segments.py), so a later prompt holding one "
        "at any position reuses it, with no POST /chunks. They live in the same tiers and "
        "budgets as registered chunks.",
    )
    auto_chunk_min_tokens: int = Field(
        32,
        ge=8,
        description="Shortest paragraph kept by auto_chunks (questions and labels are shorter).",
    )
    auto_chunk_max_tokens: int = Field(
        512,
        ge=16,
        description="Longest piece kept by auto_chunks: longer paragraphs are cut where their "
        "content says (a rolling hash), so the cuts fall at the same places in every prompt.",
    )
    auto_chunks_per_minute: int = Field(
        600,
        gt=0,
        description="Most pieces auto_chunks keeps per minute (each copies its rows and may "
        "write them to disk on the scheduler thread); pieces over the cap are counted, not kept.",
    )
    # One-off documents no longer push popular ones out, and a conversation's next turn is
    # still reused (docs/auto-chunks.md, "Under memory pressure").
    chunk_admission: Literal["adaptive", "frequency", "lru"] = Field(
        "adaptive",
        description="Which pieces kept by auto_chunks may take a place in host memory when it "
        "is full. frequency: a piece evicts the least recently used chunks only when it was "
        "seen more often than each of them (a TinyLFU frequency sketch of every piece's "
        "sights), else it is refused and its rows are never copied out; lru: every piece "
        "evicts the least recently used; adaptive: frequency or lru, whichever would have "
        "served more of the recent sights (two key-only replays of host memory's budget, "
        "about 100 bytes a chunk each). Registered chunks (POST /chunks) are always admitted.",
    )
    # docs/auto-chunks.md, "Compress before dropping".
    chunk_retention: Literal["utility", "lru"] = Field(
        "utility",
        description="Which chunks give up their room in host memory when a new one needs it. "
        "utility: the moves that lose the least expected prefill time per byte freed (a "
        "chunk's decayed reuse x the seconds a reuse saves in its form and tier): compressing "
        "a chunk one step (dense -> int8 -> int4, within chunk_retention_max_kv_error) or "
        "dropping it from host memory (a demotion where the disk or shared tier keeps it); the "
        "chunk disk tier's budget then evicts the least reused first. lru: the least recently "
        "used are dropped, nothing is compressed (the behaviour before utility retention, and "
        "what a server with --tp-size above 1 does).",
    )
    chunk_retention_max_kv_error: float = Field(
        0.01,
        ge=0,
        lt=1,
        description="Largest relative error of a chunk's K or V rows (|K' - K| / |K|, per layer, "
        "summed over its compressions) that retention by utility may keep in host memory. "
        "A compression over it is not kept (counted: compression_refused). The default keeps "
        "int8 (SmolLM2: at most 0.2 %) and refuses int4 (2.8-3.3 %), whose answers moved on "
        "Qwen2.5 (docs/compression-placement.md).",
    )
    chunk_admission_sketch_entries: int = Field(
        10_000,
        ge=64,
        le=1 << 26,
        description="Chunks the admission's frequency sketch is sized for (fixed memory of 20-33 "
        "bytes a chunk, rounded up to a power of two: 10,000 take 320 KiB; with the content key of up to as many stored chunks, ~300 bytes each: 4.7 MiB); its counts are halved every ten sights per "
        "entry, so they follow the recent traffic. Not kept across restarts: counted again "
        "from traffic.",
    )
    disk_tier: DiskTierSettings | None = Field(
        None,
        description="The TTL disk tier (HiCache storage backend hicache_ext_disk): its settings "
        "are keys of --hicache-storage-backend-extra-config beside SGLang's own (SGLang hands "
        "the backend that config only), never keys of this file. Null: no disk tier.",
    )

    def __init__(self, **values: Any) -> None:
        # Built in code or from a file, a bad value is the same one-line SettingsError.
        try:
            super().__init__(**values)
        except ValidationError as err:
            raise SettingsError(one_line(err, ExtensionSettings)) from None

    @model_validator(mode="after")
    def _lower_tiers_are_configured(self) -> ExtensionSettings:
        for tier, setting in (("disk", "chunk_disk_dir"), ("mooncake", "chunk_mooncake_master")):
            if self.chunk_tiers is None:
                break
            named = tier in self.chunk_tiers
            if named != bool(getattr(self, setting)):
                raise ValueError(
                    f"chunk_tiers names '{tier}' but {setting} is not set"
                    if named
                    else f"{setting} is set but chunk_tiers leaves out '{tier}'"
                )
        return self

    @model_validator(mode="after")
    def _placement_has_a_disk(self) -> ExtensionSettings:
        if self.chunk_placement_interval_s is not None and not self.chunk_disk_dir:
            raise ValueError(
                "chunk_placement_interval_s needs chunk_disk_dir (the disk keeps every chunk's "
                "registered rows while host memory holds the placed form)"
            )
        return self

    @model_validator(mode="after")
    def _auto_chunk_sizes_fit(self) -> ExtensionSettings:
        if self.auto_chunk_max_tokens < 2 * self.auto_chunk_min_tokens:
            raise ValueError(
                f"auto_chunk_max_tokens = {self.auto_chunk_max_tokens} must be at least twice "
                f"auto_chunk_min_tokens = {self.auto_chunk_min_tokens}"
            )
        return self

    @property
    def chunk_tier_names(self) -> tuple[str, ...]:
        """The chunk tiers in use, fastest first."""
        if self.chunk_tiers is not None:
            return tuple(self.chunk_tiers)
        lower = (("disk", self.chunk_disk_dir), ("mooncake", self.chunk_mooncake_master))
        return ("host", *(name for name, on in lower if on))

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str) -> ExtensionSettings:
        if "disk_tier" in values:
            raise SettingsError(
                f"{source}: disk_tier is not a key of this file; give the disk tier's settings "
                "as keys of --hicache-storage-backend-extra-config beside module_path"
            )
        try:  # str(key): a YAML file may hold other keys; they are unknown settings then
            return cls(**{str(key): value for key, value in values.items()})
        except SettingsError as err:
            raise SettingsError(f"{source}: {err}") from None
