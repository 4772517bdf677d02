"""End-to-end: the disk tier across a server restart, and one server per disk_dir.

A real CPU server serves requests; its TTL access history is saved in the disk folder; a
second server pointed at the same disk_dir is refused at launch (one line, exit status 2)
while the first runs; after a stop and restart on the same folder the optimiser starts from the
accesses recorded before (and can plan from them without a new request).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests

from sglang_hicache_ext.sglang_ext.server.launcher import ServerConfig, running_server
from tests.conftest import disk_tier_config, generate
from tests.test_preflight import refused_launch
from tests.test_server_disk_tier import _prompt, _set_ttls, _status

pytestmark = pytest.mark.server


def _config(model_path: Path, disk_dir: Path) -> ServerConfig:
    return disk_tier_config(model_path, disk_dir, ttl_history_save_s=1)


def _wait_saved(url: str, timeout_s: float = 30.0) -> dict:
    """The status once everything recorded is in the history file (saved every second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = _status(url)
        window = status["ttl"]["window_page_accesses"]
        if window > 0 and status["ttl_history"]["saved_page_accesses"] == window:
            return status
        assert time.monotonic() < deadline, status["ttl_history"]
        time.sleep(0.5)


def test_history_survives_a_restart_and_a_second_server_is_refused(
    tiny_smollm2_path: Path, tmp_path: Path
) -> None:
    disk_dir = tmp_path / "disk"
    with running_server(_config(tiny_smollm2_path, disk_dir), tmp_path / "first.log") as first:
        for _ in range(3):
            for topic in ("lighthouses", "glaciers"):
                generate(first.url, _prompt(topic), max_new_tokens=1)
        before = _wait_saved(first.url)
        recorded = before["ttl"]["window_page_accesses"]
        assert before["ttl_history"]["saved_requests"] == before["ttl"]["window_requests"] == 6

        second = _config(tiny_smollm2_path, disk_dir)
        started = time.monotonic()
        refused = refused_launch(second, tmp_path / "second.log")
        refused_in_s = time.monotonic() - started
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert "Traceback" not in refused.stderr
        errors = [
            line
            for line in refused.stderr.splitlines()
            if line.startswith("sglang-hicache-ext: error:")
        ]
        assert len(errors) == 1, refused.stderr[-3000:]
        assert f"disk_dir {disk_dir} is in use by another server (process " in errors[0]
        assert requests.get(f"{first.url}/health", timeout=30).status_code == 200  # unharmed
        print(f"\nsecond server ({refused_in_s:.1f} s, exit {refused.returncode}): {errors[0]}")

    # Restarted with the default policy: group TTLs behind the shadow guard.
    restarted = disk_tier_config(
        tiny_smollm2_path, disk_dir, ttl_history_save_s=1, ttl_policy="group"
    )
    with running_server(restarted, tmp_path / "again.log") as again:
        after = _status(again.url)
        history = after["ttl_history"]
        assert history["load_error"] is None, history
        assert history["reloaded_page_accesses"] == recorded, history
        assert history["reloaded_requests"] == 6
        assert after["ttl"]["window_page_accesses"] == recorded
        assert after["errors"]["history_load_errors"] == 0
        assert history["reloaded_plan"] is False  # made by another policy (group-always)
        # The first plan after the restart sees the two hot documents from before it: the group
        # candidate plans two subtree groups from the reloaded accesses. The guard still
        # publishes one TTL: a few seconds of history are one period, no evidence either way.
        plan = _set_ttls(again.url, {"replan": True})
        assert plan["replanned"], plan
        ttl = plan["ttl"]
        assert ttl["last_plan"]["choice"] == "fixed (shadow)", ttl["last_plan"]
        assert list(ttl["ttls"]) == ["default"], ttl["ttls"]
        shadows = {shadow["name"]: shadow for shadow in ttl["shadows"]}
        assert shadows["group"]["groups"] == 2 and shadows["fixed"]["groups"] == 0, shadows
        assert all(shadow["lead"] == 0.0 for shadow in shadows.values()), shadows
        print(
            f"page accesses recorded before the stop {recorded}, reloaded after the restart "
            f"{history['reloaded_page_accesses']}; first plan after it: "
            f"{ttl['last_plan']['choice']}, group candidate {shadows['group']['groups']} groups"
        )
