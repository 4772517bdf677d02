#!/usr/bin/env bash
# The GPU machine's run of benchmarks/fusion_gpu.py (device tool, nothing installed there but
# CUDA torch, Triton and nvcc): FlashInfer from the wheels that `python -m scripts.device_wheels`
# put in .whl/ (carried), this package from the working tree, FlashInfer's kernels compiled once
# (timed), then the benchmark, JSON and log under $OUT. If the run with FlashInfer fails, the
# torch-attention run still measures fused vs full prefill and the host loads.
#   device run, carry [".whl"]:  bash scripts/device_fusion_gpu.sh 480
set -uo pipefail
began=$(date +%s)
budget=${1:-480}  # seconds after which the benchmark starts no new length
out=${OUT:-/tmp/fusion-gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl || exit 1
namespace=/tmp/namespace/sglang_hicache_ext
mkdir -p "$namespace"
for folder in fusion radix tiers tuning evaluation sglang_ext; do
    ln -sfn "$PWD/$folder" "$namespace/$folder"
done
export PYTHONPATH=/tmp/namespace:/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16 HF_HUB_OFFLINE=1
# The executor on CUDA first, with torch attention and the tests' tiny model (seconds): a
# device bug stops the run here, before minutes of kernel compilation.
python3 -m benchmarks.fusion_gpu --small --device cuda --backends torch --ratios 0.15 \
    --out "$out/smoke.json" > "$out/smoke.txt" 2>&1 || { tail -30 "$out/smoke.txt"; exit 1; }
echo "smoke (tiny model on CUDA, torch attention): passed"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
    --format=csv,noheader | tee "$out/gpu.txt"
python3 - <<'PY' 2>&1 | tee -a "$out/gpu.txt"
import time

import torch
import flashinfer

print("torch", torch.__version__, "cuda", torch.version.cuda, "flashinfer", flashinfer.__version__)
q = torch.randn(256, 32, 128, device="cuda", dtype=torch.float16)
k = torch.randn(256, 8, 128, device="cuda", dtype=torch.float16)
mask = torch.ones(256, 256, dtype=torch.bool, device="cuda").tril()
for name, kwargs in (("causal", {"causal": True}), ("custom mask", {"custom_mask": mask})):
    start = time.time()
    try:
        flashinfer.single_prefill_with_kv_cache(q, k, k, **kwargs)
        torch.cuda.synchronize()
        print(f"flashinfer JIT, {name}: {time.time() - start:.1f} s")
    except Exception as err:  # reported; the benchmark then runs with torch attention
        print(f"flashinfer JIT, {name}: FAILED {type(err).__name__}: {err}")
PY
left=$(( budget - ($(date +%s) - began) ))
if ! python3 -m benchmarks.fusion_gpu --budget-s "$left" --out "$out/fusion_gpu.json" \
        2>&1 | tee "$out/log.txt"; then
    left=$(( budget - ($(date +%s) - began) ))
    python3 -m benchmarks.fusion_gpu --backends torch --budget-s "$left" \
        --out "$out/fusion_gpu_torch.json" 2>&1 | tee "$out/log_torch.txt"
fi
echo "device script: $(( $(date +%s) - began )) s"
