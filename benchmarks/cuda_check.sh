#!/usr/bin/env bash
# The CUDA path, checked on a GPU machine in one call (issue 14, item 5): the device seen,
# a short generation, offline throughput of a dummy llama-3-8b (random weights, bfloat16)
# at concurrency 1-256, and the step-time calibration.
#
#     bash benchmarks/cuda_check.sh                     # on the GPU machine, repo root
#     DEVICE=cpu SHAPE=smollm2-135m CONC=1,4 bash benchmarks/cuda_check.sh   # the script itself, here
#
# It runs from the source tree (PYTHONPATH=src) under $PYTHON (default python3: on the
# workplace's GPU image the one that holds torch with CUDA); the engine needs torch,
# transformers and numpy there, nothing else. Output: lines on stdout and files under
# $OUT (default ./cuda_check_out). Not run on a GPU yet: the README says CUDA is untested.
set -euo pipefail
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-llama-3-8b}
CONC=${CONC:-1,4,16,64,128,256}
KV_GB=${KV_GB:-40}
OUT=${OUT:-cuda_check_out}
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
flags=(--device "$DEVICE" --dtype bfloat16 --load-format dummy --model "$SHAPE"
       --kv-cache-memory-gb "$KV_GB" --max-num-seqs 256 --max-num-batched-tokens 2048
       --priority-step-time-s 0)

"$PYTHON" - "$DEVICE" <<'EOF' | tee "$OUT/device.txt"
import sys, torch
device = sys.argv[1]
ok = device == "cpu" or torch.cuda.is_available()
name = torch.cuda.get_device_name(0) if device != "cpu" and ok else "cpu"
print(f"cuda_check device={device} available={ok} name={name} torch={torch.__version__}")
sys.exit(0 if ok else 1)
EOF

"$PYTHON" - "${flags[@]}" <<'EOF' | tee "$OUT/generate.txt"
# A few greedy tokens through LLMEngine on the device: the path runs end to end and two
# identical prompts in one batch give identical tokens.
import sys, time
from tierserve.engine_args import add_engine_args, engine_config_from_args
from tierserve.engine.llm_engine import LLMEngine
from tierserve.sampling_params import SamplingParams
import argparse
p = argparse.ArgumentParser()
add_engine_args(p)
engine = LLMEngine(engine_config_from_args(p.parse_args(sys.argv[1:])))
params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
prompt = list(range(100, 164))
for rid in ("a", "b"):
    engine.add_request(rid, prompt, params)
start, out = time.perf_counter(), {}
while engine.has_unfinished_requests():
    for o in engine.step():
        if o.finished:
            out[o.request_id] = o.outputs[0].token_ids
same = out["a"] == out["b"] and len(out["a"]) == 16
print(f"cuda_check generate tokens={len(out['a'])} identical={same} "
      f"wall_s={time.perf_counter() - start:.2f}")
sys.exit(0 if same else 1)
EOF

# the physical-limit line: an H200's copy bandwidth and bf16 matmul rate as measured on the
# workplace's machines (.library/device KINDS.md: 4.3 TB/s, ~790 TFLOP/s); this CPU's here
limits=()
[ "$DEVICE" = cpu ] || limits=(--mem-bw-gbs "${MEM_BW_GBS:-4300}" --matmul-gflops "${MATMUL_GFLOPS:-790000}")
"$PYTHON" -m tierserve.cli bench throughput "${flags[@]}" --concurrency "$CONC" --no-hf \
    "${limits[@]}" | tee "$OUT/throughput.txt"
"$PYTHON" -m tierserve.cli calibrate "${flags[@]}" --out "$OUT/calibration.json" \
    | tee "$OUT/calibration.txt"
