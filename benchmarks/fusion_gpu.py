"""The fusion core on a GPU: FlashInfer vs torch attention, fused vs full prefill, host loads.

Random-weight models of real sizes (fp16, `--dtype`): Llama-3-8B's and Qwen2.5-7B's shapes
(`benchmarks/gpu_workload.py`). Each request is a short system prefix, chunks precomputed
beforehand (not timed) and a question, `--lengths` tokens in all. Per model and length:
- the full prefill through the executor with each attention backend, and the model's own
  forward, and how far the backends' logits are apart (r = 1);
- every executor call returns the request's KV, as the server's fused prefill does (it writes
  the KV into SGLang's pool for the decode);
- the fused prefill at each `--ratios` with the server's default selector (question attention,
  8 sink tokens; r = 0.3 is "auto"'s start for a model without a measured floor), each backend:
  time, speed-up over the full prefill, logits against the full prefill;
- at `--host-lengths`, the chunks in pinned host memory read four ways against the GPU
  (`benchmarks/host_chunk_loads.py`): the share of the transfer reading ahead hides;
Once per model: the attention kernel alone, FlashInfer vs torch, fp16, causal and masked.

TTFT = median over `--repeats` of one prefill to the last token's logits, after a warm-up. JSON
in benchmarks/results/ after every length (a run cut short keeps what it measured);
`--budget-s` stops starting new lengths past that many seconds. `--small` runs the tests' tiny
4-layer Llama in fp32 at 512 tokens on the CPU (torch attention only).

    python -m benchmarks.fusion_gpu                      # GPU -> fusion_gpu.json
    python -m benchmarks.fusion_gpu --small --device cpu # -> fusion_gpu_small.json
    python -m benchmarks.fusion_gpu --replot benchmarks/results/fusion_gpu_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.gpu_workload import (
    build_adapter,
    build_request,
    count_syncs,
    median_seconds,
    profile_call,
)
from benchmarks.host_chunk_loads import host_loads
from sglang_hicache_ext.fusion.adapters.hf import HFCausalLMAdapter
from sglang_hicache_ext.fusion.attention import flashinfer_available, position_causal_attention
from sglang_hicache_ext.fusion.executor import FusionResult, fused_prefill
from sglang_hicache_ext.fusion.request import ChunkSegment
from sglang_hicache_ext.fusion.selectors import Selector, make_selector

RESULTS = Path(__file__).resolve().parent / "results"
# fp16 tolerance of the attention check: FlashInfer's own tests compare with torch at 1e-3.
FP16_TOLERANCE = 1e-3


def logit_gap(logits: torch.Tensor, reference: torch.Tensor) -> dict[str, Any]:
    """How far last-token logits are from a reference: max |diff| relative to the reference's
    spread, and whether the greedy token is the same."""
    diff = float((logits.float() - reference.float()).abs().max())
    return {
        "max_logit_diff": diff,
        "max_logit_diff_rel": diff / max(float(reference.float().std()), 1e-12),
        "top1_agrees": bool(logits.argmax() == reference.argmax()),
    }


def attention_check(adapter: HFCausalLMAdapter, device: torch.device) -> dict[str, Any]:
    """FlashInfer vs torch on one attention call of the model's heads, fp16, 4,096 tokens:
    causal (a full prefill) and masked (15 % of the tokens as queries over all keys)."""
    shape = adapter.shape
    generator = torch.Generator(device=device).manual_seed(1)
    n, dim = 4096, shape.head_dim
    q = torch.randn(n, shape.num_q_heads, dim, device=device, generator=generator)
    k = torch.randn(n, shape.num_kv_heads, dim, device=device, generator=generator)
    v = torch.randn(n, shape.num_kv_heads, dim, device=device, generator=generator)
    q, k, v = q.half(), k.half(), v.half()
    positions = torch.arange(n, device=device)
    queries = torch.sort(torch.randperm(n, device=device, generator=generator)[: n * 15 // 100])
    selected = queries.values
    report: dict[str, Any] = {"dtype": "float16", "tokens": n, "tolerance": FP16_TOLERANCE}
    # (queries, their positions, what the executor tells attention): the last case is how the
    # executor calls it, blocked by the host positions, compared with one masked torch call.
    cases = {
        "causal": (q, positions, {}),
        "masked": (q[selected], selected, {}),
        "masked_blocked": (
            q[selected],
            selected,
            {"causal": False, "host_positions": selected.cpu()},
        ),
    }
    reference = position_causal_attention(q[selected], k, v, selected, positions, dim**-0.5)
    for case, (query, query_positions, told) in cases.items():
        outputs = {
            backend: position_causal_attention(
                query, k, v, query_positions, positions, dim**-0.5, backend=backend, **told
            )
            for backend in ("flashinfer", "torch")
        }
        if told:
            outputs["torch_one_call"] = reference
        first, *others = outputs.values()
        diff = max(float((first.float() - o.float()).abs().max()) for o in others)
        report[case] = {
            "compared": list(outputs),
            "max_abs_diff": diff,
            "within_tolerance": all(
                torch.allclose(first, o, atol=FP16_TOLERANCE, rtol=FP16_TOLERANCE) for o in others
            ),
        }
    return report


def run_length(
    adapter: HFCausalLMAdapter, total: int, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    segments, ids = build_request(adapter, total, args.chunk_tokens)
    full = make_selector("full", 1.0)
    row: dict[str, Any] = {
        "tokens": total,
        "chunk_tokens": sum(s.chunk.num_tokens for s in segments if isinstance(s, ChunkSegment)),
        "full": {},
        "fused": {},
    }
    reference = None
    for backend in args.backends:
        logits = fused_prefill(
            adapter, segments, full, return_kv=True, attention_backend=backend
        ).logits
        reference = logits if reference is None else reference
        row["full"][backend] = {
            "ttft_s": median_seconds(
                lambda b=backend: fused_prefill(
                    adapter, segments, full, return_kv=True, attention_backend=b
                ),
                args.repeats,
                device,
            ),
            "vs_first_backend": logit_gap(logits, reference),
        }
    assert reference is not None
    row["hf_forward"] = _hf_forward(adapter, ids.to(device), reference, args.repeats, device)
    for selector_name in args.selectors:
        for ratio in args.ratios:
            key = f"{selector_name}@{ratio}"
            row["fused"][key] = {}
            selector = make_selector(selector_name, ratio, sink_tokens=args.sink_tokens)
            for backend in args.backends:
                result = fused_prefill(
                    adapter, segments, selector, return_kv=True, attention_backend=backend
                )
                seconds = median_seconds(
                    lambda s=selector, b=backend: fused_prefill(
                        adapter, segments, s, return_kv=True, attention_backend=b
                    ),
                    args.repeats,
                    device,
                )
                row["fused"][key][backend] = {
                    "ttft_s": seconds,
                    "ttft_vs_full": seconds / row["full"][backend]["ttft_s"],
                    "selected": int(result.selected.numel()),
                    "computed_tokens_per_layer": list(result.computed_tokens),
                    "vs_full": logit_gap(result.logits, reference),
                }
                if args.profile_length == total and ratio == args.host_ratio:
                    # Where the time goes beyond the kernels, and which lines wait on the GPU.
                    def call(s: Selector = selector, b: str = backend) -> FusionResult:
                        return fused_prefill(
                            adapter, segments, s, return_kv=True, attention_backend=b
                        )

                    row["fused"][key][backend]["syncs"] = count_syncs(call, device)
                    row["fused"][key][backend]["profiled"] = profile_call(
                        call, device, args.out, f"{key} {backend}, {total} tokens"
                    )
    if total in args.host_lengths:
        # Per selector: one that scores in a pass of its own reads most layers before any
        # compute can hide the reads; one that selects before layer 0 has every layer's compute.
        row["host_loads_by_selector"] = {
            name: host_loads(
                adapter, segments, name, args.host_ratio, args, device, args.backends[0]
            )
            for name in args.selectors
        }
    return row


def _hf_forward(
    adapter: HFCausalLMAdapter,
    ids: torch.Tensor,
    reference: torch.Tensor,
    repeats: int,
    device: torch.device,
) -> dict[str, Any] | None:
    """The model's own forward (last-token logits): a bound for the executor's full prefill."""
    model = adapter.model

    def forward() -> torch.Tensor:
        with torch.inference_mode():
            return model(ids[None], use_cache=False, logits_to_keep=1).logits[0, -1]

    try:
        logits = forward()
        return {"ttft_s": median_seconds(forward, repeats, device), **logit_gap(logits, reference)}
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny 4-layer fp32 model, 512 tokens")
    parser.add_argument("--models", nargs="+", default=None, help="llama3_8b qwen2_5_7b")
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--chunk-tokens", type=int, default=None)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.15, 0.3])
    parser.add_argument("--selectors", nargs="+", default=["question_attention"])
    parser.add_argument("--sink-tokens", type=int, default=8, help="the server's default")
    parser.add_argument("--backends", nargs="+", default=None, help="flashinfer torch")
    parser.add_argument("--host-lengths", type=int, nargs="*", default=None)
    parser.add_argument("--host-ratio", type=float, default=0.15)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=None, help="no new length after this")
    parser.add_argument("--profile-length", type=int, default=None, help="profile one call")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--replot", type=Path, default=None, help="plot a results JSON again")
    args = parser.parse_args(argv)
    args.models = args.models or (["tiny_llama"] if args.small else ["llama3_8b", "qwen2_5_7b"])
    args.lengths = args.lengths or ([512] if args.small else [4096, 16384, 32768])
    args.host_lengths = args.host_lengths if args.host_lengths is not None else args.lengths[:2]
    args.chunk_tokens = args.chunk_tokens or (128 if args.small else 1024)
    args.repeats = args.repeats or (1 if args.small else 3)
    args.out = args.out or RESULTS / ("fusion_gpu_small.json" if args.small else "fusion_gpu.json")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    began = time.monotonic()
    args = parse_args(argv)
    if args.replot:
        report = json.loads(args.replot.read_text())
        plot(report, args.replot.with_suffix(".png"))
        return report
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not args.small and device.type != "cuda":
        raise SystemExit("the full-size benchmark needs a CUDA device; use --small on CPU")
    if args.backends is None:
        usable = device.type == "cuda" and flashinfer_available()
        args.backends = ["flashinfer", "torch"] if usable else ["torch"]
    dtype = getattr(torch, args.dtype or ("float32" if args.small else "float16"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".profile.txt").unlink(missing_ok=True)  # this run's profiles only
    report: dict[str, Any] = {
        "benchmark": "fusion_gpu",
        "command": " ".join(["python -m benchmarks.fusion_gpu", *(argv or sys.argv[1:])]),
        "small": args.small,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.machine(),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "flashinfer": _flashinfer_version(),
        "backends": args.backends,
        "selectors": args.selectors,
        "ratios": args.ratios,
        "sink_tokens": args.sink_tokens,
        "repeats": args.repeats,
        "models": [],
    }
    for name in args.models:
        adapter = build_adapter(name, device, dtype)
        shape = adapter.shape
        model: dict[str, Any] = {
            "name": name,
            "layers": shape.num_layers,
            "q_heads": shape.num_q_heads,
            "kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim,
            "results": [],
            "skipped_lengths": [],
        }
        report["models"].append(model)
        if "flashinfer" in args.backends:
            model["attention_check"] = attention_check(adapter, device)
            tqdm.write(f"{name} attention check: {json.dumps(model['attention_check'])}")
        for total in args.lengths:
            if args.budget_s is not None and time.monotonic() - began > args.budget_s:
                model["skipped_lengths"].append(total)
                continue
            row = run_length(adapter, total, args, device)
            model["results"].append(row)
            _write(report, args.out)
            tqdm.write(f"{name} {total} tokens: {_summary(row)}")
        del adapter
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["wall_s"] = time.monotonic() - began
    _write(report, args.out)
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and its plot")
    return report


def plot(report: dict[str, Any], out: Path) -> None:
    """Fused TTFT ÷ full prefill by length (each model, ratio and backend), and the fused
    prefill's TTFT with its chunks on the GPU vs in host memory read four ways."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = report["models"]
    figure, axes = plt.subplots(1, len(models) + 1, figsize=(5 * (len(models) + 1), 4), dpi=110)
    *lefts, right = axes
    styles = {"torch": "-", "flashinfer": "--"}  # colour: selector and ratio; line: backend
    for left, model in zip(lefts, models, strict=True):
        rows = sorted(model["results"], key=lambda r: r["tokens"])
        for colour, key in enumerate(rows[0]["fused"] if rows else ()):
            for backend in rows[0]["fused"][key]:
                xs = [r["tokens"] for r in rows]
                ys = [r["fused"][key][backend]["ttft_vs_full"] for r in rows]
                left.plot(
                    xs, ys, styles.get(backend, ":"), marker="o", color=f"C{colour}",
                    label=f"{key} ({backend})",
                )  # fmt: skip
        left.axhline(1.0, color="grey", linewidth=1)
        left.axhline(0.25, color="grey", linestyle=":", linewidth=1)
        left.set_xscale("log", base=2)
        left.set_xlabel("prompt tokens")
        left.set_ylabel("fused TTFT ÷ full prefill")
        left.set_title(model["name"], fontsize=9)
        left.legend(fontsize=6)
        left.grid(alpha=0.3)
    variants = ("gpu", "host_serial", "host_overlapped", "host_overlapped_sparse", "host_plain")
    hosts = [
        (f"{m['name']} {r['tokens']}\n{selector}", loads)
        for m in report["models"]
        for r in sorted(m["results"], key=lambda r: r["tokens"])
        for selector, loads in _host_loads(r).items()
    ]
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        xs = [j + i * width for j in range(len(hosts))]
        right.bar(xs, [h[variant]["ttft_s"] * 1e3 for _, h in hosts], width, label=variant)
    right.set_xticks([j + 0.4 - width / 2 for j in range(len(hosts))])
    right.set_xticklabels([name for name, _ in hosts], fontsize=7)
    right.set_ylabel("fused TTFT (ms), chunks where")
    right.legend(fontsize=7)
    right.grid(alpha=0.3, axis="y")
    figure.suptitle(f"{report['device']}, {report['dtype']}, {'/'.join(report['backends'])}")
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)


def _summary(row: dict[str, Any]) -> str:
    parts = [f"full {b} {r['ttft_s'] * 1e3:.1f} ms" for b, r in row["full"].items()]
    for key, by_backend in row["fused"].items():
        for backend, r in by_backend.items():
            parts.append(f"{key} {backend} {r['ttft_s'] * 1e3:.1f} ms (x{r['ttft_vs_full']:.2f})")
    for selector, loads in _host_loads(row).items():
        parts.append(f"host loads ({selector}) hidden share {loads['hidden_share']}")
    return "; ".join(parts)


def _host_loads(row: dict[str, Any]) -> dict[str, Any]:
    """Host-load rows by selector (results before 2026-11-28's second run had one, unnamed)."""
    if "host_loads_by_selector" in row:
        return dict(row["host_loads_by_selector"])
    old = row.get("host_loads")
    return {old["selector"]: old} if old else {}


def _flashinfer_version() -> str | None:
    if not flashinfer_available():
        return None
    import flashinfer

    return str(flashinfer.__version__)


def _write(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
