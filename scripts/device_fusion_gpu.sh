#!/usr/bin/env bash
# The GPU machine's run of benchmarks/fusion_gpu.py (device tool, nothing installed there but
# CUDA torch, Triton and nvcc): FlashInfer from the wheels that `python -m scripts.device_wheels`
# put in .whl/ (carried), this package from the working tree, FlashInfer's kernels compiled once
# (timed), then the benchmark, JSON and log under $OUT. If the run with FlashInfer fails, the
# torch-attention run still measures fused vs full prefill and the host loads.
#   device run, carry [".whl"]:  bash scripts/device_fusion_gpu.sh 480 [benchmark arguments]
set -uo pipefail
began=$(date +%s)
budget=${1:-480}  # seconds after which the benchmark starts no new length
shift $(( $# > 0 ? 1 : 0 ))
extra=("$@")  # e.g. --models llama3_8b
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
rm -f "$out/smoke.png"  # the device tool brings back 8 files at most
echo "smoke (tiny model on CUDA, torch attention): passed"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
    --format=csv,noheader | tee "$out/gpu.txt"
# FlashInfer compiles a kernel module per mask kind on first use: the causal one (full
# prefill) and the custom-mask one (fused prefill) are built side by side, 8 jobs each.
cat > /tmp/jit_warmup.py <<'PY'
import sys
import time

import torch
import flashinfer

mode = sys.argv[1]
q = torch.randn(256, 32, 128, device="cuda", dtype=torch.float16)
k = torch.randn(256, 8, 128, device="cuda", dtype=torch.float16)
mask = torch.ones(256, 256, dtype=torch.bool, device="cuda").tril()
kwargs = {"causal": True} if mode == "causal" else {"custom_mask": mask}
start = time.time()
try:
    flashinfer.single_prefill_with_kv_cache(q, k, k, **kwargs)
    torch.cuda.synchronize()
    print(f"flashinfer {flashinfer.__version__} JIT, {mode}: {time.time() - start:.1f} s")
except Exception as err:  # reported; the benchmark then runs with torch attention
    print(f"flashinfer JIT, {mode}: FAILED {type(err).__name__}: {str(err)[-2000:]}")
PY
MAX_JOBS=8 python3 /tmp/jit_warmup.py causal > "$out/jit_causal.txt" 2>&1 &
MAX_JOBS=8 python3 /tmp/jit_warmup.py custom > "$out/jit_custom.txt" 2>&1 &
wait
tail -n 3 "$out/jit_causal.txt" "$out/jit_custom.txt" | tee -a "$out/gpu.txt"
rm "$out/jit_causal.txt" "$out/jit_custom.txt"
left=$(( budget - ($(date +%s) - began) ))
# 16K first: the length the acceptance reads; one fused call there is profiled. `freq` selects
# before layer 0 (no scoring pass): the fused prefill's cost without the question's first pass.
if ! python3 -m benchmarks.fusion_gpu --lengths 16384 4096 32768 --profile-length 16384 \
        --host-lengths 16384 --selectors question_attention freq --budget-s "$left" \
        --out "$out/fusion_gpu.json" "${extra[@]}" 2>&1 | tee "$out/log.txt"; then
    left=$(( budget - ($(date +%s) - began) ))
    python3 -m benchmarks.fusion_gpu --lengths 16384 4096 32768 --backends torch --budget-s "$left" \
        --host-lengths 16384 --selectors question_attention freq \
        --out "$out/fusion_gpu_torch.json" "${extra[@]}" 2>&1 | tee "$out/log_torch.txt"
fi
echo "device script: $(( $(date +%s) - began )) s"
