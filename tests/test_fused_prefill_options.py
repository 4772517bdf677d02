"""Per-request fusion options and the adapter's refusal of unsupported model classes."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_hicache_ext.sglang_ext.chunk_fusion.adapters.registry import (
    NoAdapterError,
    adapter_class,
)
from sglang_hicache_ext.sglang_ext.chunk_fusion.model_check import ModelCheck
from sglang_hicache_ext.sglang_ext.chunk_fusion.request_options import FusionOptions, parse_options
from sglang_hicache_ext.sglang_ext.config.settings import (
    DEFAULT_TARGET_AGREEMENT,
    ExtensionSettings,
    SettingsError,
)

DEFAULTS = ExtensionSettings(
    fusion_by_default=False,
    fusion_selector="a3",
    fusion_recompute_ratio=0.15,
    fusion_sink_tokens=0,
    fusion_fresh_layers=0,
    fusion_context_temperature=1.0,
    fusion_context_scale=1.0,
)
PLAIN = {"fresh_layers": 0, "context_temperature": 1.0, "context_scale": 1.0}


def test_shipped_default_is_the_measured_closest_selector() -> None:
    # docs/fusion-quality.md: question_attention + 8 sink tokens closes the most teacher-forced
    # KL; fresh layers and APE's tempering measured no better, so they are off by default. The
    # ratio is "auto" with a token-agreement target the shadow checks hold ("Fidelity in
    # production"), checked on a quarter of the fused requests.
    shipped = parse_options({"fusion": True}, ExtensionSettings())
    assert (shipped.selector, shipped.sink_tokens, shipped.recompute_ratio) == (
        "question_attention",
        8,
        "auto",
    )
    assert ExtensionSettings().fusion_target_agreement == DEFAULT_TARGET_AGREEMENT
    assert ExtensionSettings().fusion_shadow_rate > 0
    assert shipped.shadow is None  # checked at the rate, not forced
    assert (shipped.fresh_layers, shipped.context_temperature, shipped.context_scale) == (0, 1, 1)


def test_defaults_and_overrides() -> None:
    assert parse_options(None, DEFAULTS) == FusionOptions(
        enabled=False,
        selector="a3",
        recompute_ratio=0.15,
        sink_tokens=0,
        overlap_loads=True,
        **PLAIN,
    )
    assert parse_options({"fusion": True, "fusion_recompute_ratio": 1}, DEFAULTS) == FusionOptions(
        enabled=True,
        selector="a3",
        recompute_ratio=1.0,
        sink_tokens=0,
        overlap_loads=True,
        **PLAIN,
    )
    assert parse_options({"fusion_fresh_layers": 2}, DEFAULTS).fresh_layers == 2
    tempered = parse_options(
        {"fusion_context_temperature": 0.9, "fusion_context_scale": 0.8}, DEFAULTS
    )
    assert (tempered.context_temperature, tempered.context_scale) == (0.9, 0.8)
    assert parse_options({"fusion_selector": "epic", "other_key": 3}, DEFAULTS).selector == "epic"
    assert parse_options({"fusion_sink_tokens": 4}, DEFAULTS).sink_tokens == 4
    assert not parse_options({"fusion_overlap_loads": False}, DEFAULTS).overlap_loads
    assert parse_options(None, DEFAULTS).decode_capacity is None  # the decode reads every row
    assert parse_options({"fusion_decode_capacity": 0.25}, DEFAULTS).decode_capacity == 0.25
    with_capacity = ExtensionSettings(fusion_decode_capacity=0.5)
    assert parse_options({"fusion": True}, with_capacity).decode_capacity == 0.5
    with_sinks = ExtensionSettings(fusion_sink_tokens=2)
    assert parse_options({"fusion": True}, with_sinks).sink_tokens == 2


def test_frontend_sends_only_the_options_it_sets() -> None:
    from sglang_hicache_ext.sglang_ext.frontend import FusionRequest

    assert FusionRequest().custom_params() == {"fusion": True}  # the server's defaults apply
    assert FusionRequest(sink_tokens=4).custom_params()["fusion_sink_tokens"] == 4
    assert FusionRequest(decode_capacity=0.25).custom_params()["fusion_decode_capacity"] == 0.25
    assert FusionRequest("epic", 0.3).custom_params() == {
        "fusion": True,
        "fusion_selector": "epic",
        "fusion_recompute_ratio": 0.3,
    }
    # What the frontend leaves unset, the server fills from its settings.
    parsed = parse_options(FusionRequest().custom_params(), DEFAULTS)
    assert (parsed.selector, parsed.recompute_ratio) == (
        DEFAULTS.fusion_selector,
        DEFAULTS.fusion_recompute_ratio,
    )


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"fusion_recompute_ratio": 1.01}, r"in \[0, 1\]"),
        ({"fusion_recompute_ratio": True}, r"in \[0, 1\]"),
        ({"fusion_recompute_ratio": "0.1"}, r"in \[0, 1\]"),
        ({"fusion_selector": "nope"}, "is unknown"),
        ({"fusion_sink_tokens": -1}, "integer >= 0"),
        ({"fusion_fresh_layers": -1}, "integer >= 0"),
        ({"fusion_fresh_layers": 1.5}, "integer >= 0"),
        ({"fusion_context_temperature": 0}, r"fusion_context_temperature must be a number > 0"),
        ({"fusion_context_scale": -0.5}, r"fusion_context_scale must be a number > 0"),
        ({"fusion_context_scale": 10}, r"fusion_context_scale must be a number .*<= 4"),
        ({"fusion_context_temperature": "hot"}, "must be a number"),
        ({"fusion_sink_tokens": 1.5}, "integer >= 0"),
        ({"fusion_sink_tokens": True}, "integer >= 0"),
        ({"fusion": 1}, "true or false"),
        ({"fusion_overlap_loads": "no"}, "fusion_overlap_loads must be true or false"),
        ("not a dict", "must be an object"),
    ],
)
def test_bad_options(params: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_options(params, DEFAULTS)


def test_auto_ratio_with_and_without_a_ratio_table() -> None:
    # Without a table the server tunes "auto" itself (tuning/ratio/self_tuned.py).
    untuned = parse_options({"fusion": True, "fusion_recompute_ratio": "auto"}, DEFAULTS)
    assert untuned.recompute_ratio == "auto"
    tuned = DEFAULTS.model_copy(update={"fusion_ratio_table": "/srv/ratios.json"})
    options = parse_options({"fusion": True, "fusion_recompute_ratio": "auto"}, tuned)
    assert options.recompute_ratio == "auto"
    with pytest.raises(ValueError, match=r'a number in \[0, 1\] or "auto", got \'AUTO\''):
        parse_options({"fusion_recompute_ratio": "AUTO"}, tuned)


def test_a_ratio_table_under_home_is_read_as_the_launch_check_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fusion_ratio_table = "~/..."` passes the launch check (which expands `~`); the scheduler
    reads the same file, rather than failing every "auto" request with `ratio_not_tuned`."""
    from sglang_hicache_ext.sglang_ext.chunk_fusion.service import FusionService
    from sglang_hicache_ext.tuning.ratio.table import RatioTable, TunedRatio

    monkeypatch.setenv("HOME", str(tmp_path))
    table = RatioTable("m", {"host": TunedRatio(0.2, 0.15, 0.1, 1.0, "roofline prior")})
    table.save(tmp_path / "ratios.json")
    runtime = SimpleNamespace(
        _ratio_table=None,
        settings=DEFAULTS.model_copy(update={"fusion_ratio_table": "~/ratios.json"}),
    )
    assert FusionService.ratio_table(runtime).tiers["host"].ratio == 0.2  # type: ignore[arg-type]


def test_auto_ratio_setting_with_or_without_a_table() -> None:
    assert (
        parse_options(
            {"fusion": True}, ExtensionSettings(fusion_recompute_ratio="auto")
        ).recompute_ratio
        == "auto"
    )
    settings = ExtensionSettings(fusion_recompute_ratio="auto", fusion_ratio_table="/r.json")
    assert parse_options({"fusion": True}, settings).recompute_ratio == "auto"
    with pytest.raises(SettingsError, match=re.escape('= 1.5 must be in [0, 1] or "auto"')):
        ExtensionSettings(fusion_recompute_ratio=1.5)


def test_model_family_without_adapter_is_refused_by_name() -> None:
    class BloomForCausalLM:  # a real SGLang class name that has no fusion adapter
        pass

    with pytest.raises(
        NoAdapterError, match="no adapter for BloomForCausalLM; supported: .*Gemma3"
    ):
        adapter_class(BloomForCausalLM)


def test_deepseek_mla_is_refused_with_its_reason() -> None:
    class DeepseekV2ForCausalLM:
        pass

    class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
        pass

    with pytest.raises(NoAdapterError, match="MLA keeps one latent vector"):
        adapter_class(DeepseekV3ForCausalLM)


def test_model_without_adapter_falls_back_as_no_adapter_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class BloomForCausalLM:
        pass

    runner = SimpleNamespace(
        model=BloomForCausalLM(), model_config=SimpleNamespace(hf_config=None), attn_backend=None
    )
    check = ModelCheck()
    with caplog.at_level("ERROR"):
        assert check.adapter(runner) is None
        assert check.adapter(runner) is None  # decided once: no second attempt, no second line
    assert check.fallback == "no_adapter" and check.stats()["state"] == "no_adapter"
    (line,) = [r.getMessage() for r in caplog.records if "fusion disabled" in r.getMessage()]
    # The launch log names the families that have an adapter.
    assert (
        "BloomForCausalLM" in line and "Qwen3MoeForCausalLM" in line and "Gemma2ForCausalLM" in line
    )


def test_a_prompt_matched_below_the_break_even_share_is_not_fused_with_the_servers_ratio() -> None:
    from sglang_hicache_ext.sglang_ext.chunk_fusion.plan import below_break_even

    auto = parse_options({"fusion": True}, ExtensionSettings())
    pinned = parse_options({"fusion": True, "fusion_recompute_ratio": 0.15}, ExtensionSettings())
    spans = [(10, 110), (150, 250)]  # 200 chunk tokens of a 1,000-token prompt
    assert below_break_even(0.25, auto, spans, 0, 1000)  # 0.2 of the prefill matched
    assert not below_break_even(0.2, auto, spans, 0, 1000)  # exactly the minimum: fused
    assert not below_break_even(0.25, pinned, spans, 0, 1000)  # a pinned ratio is fused
    assert not below_break_even(0.0, auto, [], 0, 1000)  # no minimum
    # Past a cached prefix that ends inside the second chunk: 50 of 250 tokens matched.
    assert below_break_even(0.25, auto, spans, 200, 450)
    assert not below_break_even(0.2, auto, spans, 200, 450)
    assert not below_break_even(0.25, None, spans, 0, 1000)  # did not ask
