"""Summary and table of `benchmarks.fusion_breakdown`: six stages per mode, ratios, bounds."""

from __future__ import annotations

import statistics
from typing import Any

STAGES = ("match", "load", "selection", "recompute", "attention", "overhead")
OVERHEAD_PARTS = ("assemble", "pool_write", "overhead_other")


def stage_table(median_s: dict[str, float]) -> dict[str, float]:
    """The six stages (overhead = KV assembly + pool write + the rest) from one mode's medians."""
    table = {stage: median_s.get(stage, 0.0) for stage in STAGES[:-1]}
    table["overhead"] = sum(median_s.get(k, 0.0) for k in OVERHEAD_PARTS)
    return table


def _median_over_prompts(per_prompt: list[dict[str, Any]], mode: str) -> dict[str, float]:
    keys = {k for p in per_prompt for k in p["modes"][mode]["median_s"]}
    return {
        k: statistics.median(p["modes"][mode]["median_s"].get(k, 0.0) for p in per_prompt)
        for k in keys
    }


def _paired_ratio(per_prompt: list[dict[str, Any]], mode: str, reference: str) -> float | None:
    """Median over prompts and repeats of mode / reference within the same repeat (the two ran
    back to back), or None when the reference mode was not measured."""
    ratios = [
        ours / theirs
        for p in per_prompt
        if reference in p["modes"]
        for ours, theirs in zip(
            p["modes"][mode]["totals_s"], p["modes"][reference]["totals_s"], strict=True
        )
    ]
    return statistics.median(ratios) if ratios else None


def summarize(per_prompt: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Per mode: median stages over prompts, shares, MACs, TTFT ratios to `normal` and the
    time bound (the mode's MACs at the normal prefill's own measured seconds per MAC)."""
    summary: dict[str, Any] = {}
    for mode in modes:
        median_s = _median_over_prompts(per_prompt, mode)
        stages = stage_table(median_s)
        total = median_s["total"]
        work = [p["modes"][mode]["work"] for p in per_prompt]
        summary[mode] = {
            "median_total_s": total,
            "stages_s": stages,
            "stage_share": {k: v / total for k, v in stages.items()},
            "overhead_detail_s": {k: median_s.get(k, 0.0) for k in OVERHEAD_PARTS},
            "macs": {k: statistics.median(w[k] for w in work) for k in work[0]},
            "macs_needed": {
                k: statistics.median(p["modes"][mode]["work_needed"][k] for p in per_prompt)
                for k in work[0]
            },
        }
    normal = summary["normal"]
    linear_rate = normal["stages_s"]["recompute"] / (
        normal["macs"]["linear"] + normal["macs"]["lm_head"]
    )
    attention_rate = normal["stages_s"]["attention"] / normal["macs"]["attention"]
    for mode in modes:
        ratios = [
            statistics.median(p["modes"][mode]["totals_s"])
            / statistics.median(p["modes"]["normal"]["totals_s"])
            for p in per_prompt
        ]
        entry, macs = summary[mode], summary[mode]["macs"]
        entry["ttft_ratio_median_of_prompts"] = statistics.median(ratios)
        entry["ttft_ratio_paired"] = _paired_ratio(per_prompt, mode, "normal")
        if "@" in mode:
            entry["ratio_to_unvaried_paired"] = _paired_ratio(per_prompt, mode, mode.split("@")[0])
        entry["ttft_ratio_of_medians"] = entry["median_total_s"] / normal["median_total_s"]
        entry["mac_fraction_of_normal"] = sum(macs.values()) / sum(normal["macs"].values())
        entry["needed_mac_fraction_of_normal"] = sum(entry["macs_needed"].values()) / sum(
            normal["macs"].values()
        )
        entry["attention_mac_fraction_of_normal"] = macs["attention"] / normal["macs"]["attention"]
        entry["linear_mac_fraction_of_normal"] = macs["linear"] / normal["macs"]["linear"]
        for name, counted in (("time_bound", macs), ("needed_time_bound", entry["macs_needed"])):
            seconds = (
                counted["linear"] + counted["lm_head"] + counted["selection"]
            ) * linear_rate + counted["attention"] * attention_rate
            entry[f"{name}_s"] = seconds
            entry[f"{name}_ratio"] = seconds / normal["median_total_s"]
    return summary


def print_table(summary: dict[str, Any], modes: list[str]) -> None:
    print(f"\n{'stage':<11}" + "".join(f"{m:>22}" for m in modes))
    for stage in (*STAGES, "total"):
        cells = []
        for mode in modes:
            entry = summary[mode]
            seconds = entry["median_total_s"] if stage == "total" else entry["stages_s"][stage]
            cells.append(f"{seconds:>10.3f}s {seconds / entry['median_total_s']:>7.1%}")
        print(f"{stage:<11}" + "".join(f"{c:>22}" for c in cells))
    for mode in modes:
        entry = summary[mode]
        paired = entry.get("ratio_to_unvaried_paired")
        against = "" if paired is None else f", {paired:.3f}x {mode.split('@')[0]} (paired)"
        print(
            f"{mode}: {entry['ttft_ratio_of_medians']:.3f}x normal (paired per repeat "
            f"{entry['ttft_ratio_paired']:.3f}{against}); MACs {entry['mac_fraction_of_normal']:.3f}x "
            f"(linear {entry['linear_mac_fraction_of_normal']:.3f}, attention "
            f"{entry['attention_mac_fraction_of_normal']:.3f}); time bound "
            f"{entry['time_bound_s']:.3f}s = {entry['time_bound_ratio']:.3f}x; needed (last "
            f"layer: last row only) MACs {entry['needed_mac_fraction_of_normal']:.3f}x, "
            f"{entry['needed_time_bound_ratio']:.3f}x"
        )
