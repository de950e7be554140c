"""A model's recommended sampling defaults, used where a request gives none
(`--generation-config`, as vLLM's flag: `auto`, `vllm`, or a folder).

`auto` reads `generation_config.json` beside the weights (a Hugging Face folder, or the
GGUF file's folder), as vLLM does; a GGUF file carries no sampling defaults, so for the
models tierserve ships the ones their makers publish are known here. `vllm` uses none:
OpenAI's defaults (temperature 1, top_p 1), on which a 135M model writes noise to the end
of its context. A folder path reads that folder's `generation_config.json`.

Only sampling fields are taken (temperature, top_p, top_k, min_p, repetition_penalty)
and `max_new_tokens` as the default `max_tokens`; a request's own values always win.
"""

import json
import os

from tierserve.errors import ConfigError

FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
          "min_p": "min_p", "repetition_penalty": "repetition_penalty",
          "max_new_tokens": "max_tokens"}
"""generation_config.json key -> the request field it defaults."""
KNOWN = (
    # (what the file name or GGUF name contains, defaults, where they come from)
    ("smollm2", {"temperature": 0.2, "top_p": 0.9, "max_tokens": 256},
     "SmolLM2-135M-Instruct's model card (temperature, top_p); max_tokens is tierserve's "
     "cap for this 135M model, which at any temperature above 0 sometimes loops to the "
     "end of its context"),
    ("gemma-3", {"temperature": 1.0, "top_k": 64, "top_p": 0.95},
     "Gemma 3's generation_config.json"),
    ("gemma3", {"temperature": 1.0, "top_k": 64, "top_p": 0.95},
     "Gemma 3's generation_config.json"),
)


def generation_defaults(setting: str, model_path: str | None, model_name: str = "") -> \
        tuple[dict, str]:
    """(request field -> default, where they came from) for `--generation-config
    setting`; model_path is the weights' file or folder (None: dummy weights)."""
    if setting == "vllm":
        return {}, "none (--generation-config vllm: OpenAI's defaults)"
    if setting != "auto":
        path = os.path.join(setting, "generation_config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"--generation-config {setting}: no generation_config.json "
                              "there (give a folder with one, auto or vllm)")
        return _read(path), path
    if model_path is None:
        return {}, "none (dummy weights)"
    folder = model_path if os.path.isdir(model_path) else os.path.dirname(model_path)
    path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(path):
        found = _read(path)
        if found:
            return found, path
    key = f"{os.path.basename(model_path)} {model_name}".lower()
    for needle, defaults, source in KNOWN:
        if needle in key:
            return dict(defaults), source
    return {}, "none found (OpenAI's defaults)"


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    out = {}
    for key, field in FIELDS.items():
        value = raw.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[field] = value
    return out


def describe(defaults: dict) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in defaults.items()) or "none"


def request_sampling(defaults: dict) -> dict:
    """The SamplingParams fields a request that gives no sampling field gets from a model's
    defaults (max_tokens aside): what calibration and the benchmarks' workloads sample
    with, so their steps pay the sampler a real request pays."""
    return {k: v for k, v in defaults.items()
            if k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
