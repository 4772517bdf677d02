"""The scheduler's side of the extension's control channel: `hicache_ext.*` methods.

The HTTP process's routes (`server/control_routes.py: control`) send SGLang's dumper-control
request with a `hicache_ext.` method; this AROUND hook on `Scheduler.handle_dumper_control`
answers it from the scheduler's state: the chunk registry's listings, descriptions, deletions
and placement (`chunk_listing.chunk_control`), the TTL disk tier's status and TTL overrides, and the shadow
checks' results for the live fidelity window. Every other method is SGLang's own.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_hicache_ext.sglang_ext.chunk_fusion.chunk_listing import chunk_control
from sglang_hicache_ext.sglang_ext.chunk_fusion.registry import CONTROL_PREFIX
from sglang_hicache_ext.sglang_ext.chunk_fusion.service import service_of
from sglang_hicache_ext.sglang_ext.chunk_fusion.shadow_request import FIDELITY_RECORD_METHOD

logger = logging.getLogger(__name__)


def handle_control(original: Any, scheduler: Any, recv_req: Any) -> Any:
    """AROUND hook on Scheduler.handle_dumper_control: serve `hicache_ext.*` methods."""
    if not str(recv_req.method).startswith(CONTROL_PREFIX):
        return original(scheduler, recv_req)
    from sglang.srt.managers.io_struct import DumperControlReqOutput

    if str(recv_req.method).startswith(STORAGE_CONTROL_PREFIX):
        return _handle_storage_control(scheduler, recv_req)
    if str(recv_req.method) == CONTROL_PREFIX + FIDELITY_RECORD_METHOD:
        return _handle_fidelity_record(scheduler, recv_req)
    fusion = service_of(scheduler.tree_cache)
    try:
        if fusion is None:
            reason = getattr(
                scheduler.tree_cache,
                "fusion_unavailable",
                "--radix-cache-backend hicache_ext is not in use",
            )
            raise RuntimeError(f"chunk registry unavailable: {reason}")
        if fusion.auto_capture is not None:  # listings and deletions see every piece kept so far
            fusion.auto_capture.settle(wait=True)
        response = chunk_control(fusion.registry, recv_req.method, dict(recv_req.body))
        output = DumperControlReqOutput(success=True, response=response)
    except (RuntimeError, ValueError) as err:
        output = DumperControlReqOutput(success=False, response=[], error=str(err))
    scheduler.ipc_channels.send_to_tokenizer.send_output(output, recv_req)
    return None


STORAGE_CONTROL_PREFIX = CONTROL_PREFIX + "storage."


def _handle_fidelity_record(scheduler: Any, recv_req: Any) -> None:
    """`hicache_ext.fidelity.record`: one shadow check's result for the live window and the
    agreement target (`tuning/ratio/live_fidelity.py`)."""
    from sglang.srt.managers.io_struct import DumperControlReqOutput

    fusion = service_of(scheduler.tree_cache)
    try:
        if fusion is None:
            raise RuntimeError("fusion is not in use on this server")
        response = [fusion.fidelity.record(dict(recv_req.body))]
        output = DumperControlReqOutput(success=True, response=response)
    except (RuntimeError, ValueError) as err:
        output = DumperControlReqOutput(success=False, response=[], error=str(err))
    scheduler.ipc_channels.send_to_tokenizer.send_output(output, recv_req)


def _handle_storage_control(scheduler: Any, recv_req: Any) -> None:
    """`hicache_ext.storage.status` / `.ttl`: the disk tier's metrics and TTL overrides."""
    from sglang.srt.managers.io_struct import DumperControlReqOutput

    disk_tier = getattr(scheduler.tree_cache, "disk_tier", None)
    name = str(recv_req.method)[len(STORAGE_CONTROL_PREFIX) :]
    body = dict(recv_req.body)
    try:
        if disk_tier is None:
            raise RuntimeError(
                "the disk tier is not in use (start with --radix-cache-backend hicache_ext, "
                "--enable-hierarchical-cache and --hicache-storage-backend dynamic with "
                "sglang_hicache_ext.sglang_ext.disk_tier.storage_backend.GroupTTLDiskStorage)"
            )
        if name == "status":
            response = disk_tier.status(pages=int(body.get("pages", 0)))
        elif name == "ttl":
            response = _apply_ttl_request(disk_tier, body)
        else:
            raise ValueError(f"unknown hicache_ext control method {recv_req.method!r}")
        output = DumperControlReqOutput(success=True, response=[response])
    except (RuntimeError, ValueError, TypeError) as err:
        output = DumperControlReqOutput(success=False, response=[], error=str(err))
    scheduler.ipc_channels.send_to_tokenizer.send_output(output, recv_req)


def _apply_ttl_request(disk_tier: Any, body: dict[str, Any]) -> dict[str, Any]:
    """`{"replan": true}` or `{"default_ttl_s": S, "ttls": {group: S}}`; anything else, a
    string for a number, a bool for a number or a number for a bool, is a ValueError (400)."""
    import math

    from sglang_hicache_ext.tiers.pages.ttl_policy import TtlTable

    usage = 'send {"replan": true} or {"default_ttl_s": S, "ttls": {group: S}}'
    unknown = sorted(set(body) - {"replan", "default_ttl_s", "ttls"})
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))[:200]}; {usage}")

    def seconds(name: str, value: Any) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r:.80}")
        return float(value)

    replan = body.get("replan", False)
    if not isinstance(replan, bool):
        raise ValueError(f'"replan" must be true or false, got {replan!r:.80}')
    if replan:
        if len(body) > 1:
            raise ValueError(f'"replan": true takes no other keys; {usage}')
        record = disk_tier.online.replan()
        return {"replanned": record is not None, "ttl": disk_tier.online.status()}
    if "default_ttl_s" not in body:
        raise ValueError(usage)
    ttls = body.get("ttls", {})
    if not isinstance(ttls, dict):
        raise ValueError('"ttls" must map group names to seconds')
    table = TtlTable(
        seconds("default_ttl_s", body["default_ttl_s"]),
        {str(k): seconds(f"ttls[{str(k)[:40]!r}]", v) for k, v in ttls.items()},
    )
    disk_tier.online.policy.update(table)
    logger.warning("hicache_ext: TTLs set by request (until the next plan): %s", table.as_dict())
    return {"ttl": disk_tier.online.status()}
