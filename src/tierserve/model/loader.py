"""Find, read and place weights: GGUF files, Hugging Face folders, or dummy (random) weights.

Every source yields (Hugging Face name, tensor) pairs; `load_weights` maps those names onto
the fused parameters of `LlamaModel` (q/k/v into qkv_proj, gate/up into gate_up_proj).
`--model gemma3-270m` names the packaged Gemma 3 (metadata.model_path).
"""

import glob
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from tierserve.config import ModelConfig
from tierserve.errors import ConfigError, ModelLoadError
from tierserve.model.gguf_file import GGUFCheckpoint
from tierserve.model.llama import LlamaModel, RotaryEmbedding
from tierserve.model.metadata import default_model_path, hf_shape, model_path  # noqa: F401
from tierserve.model.metadata import read_shape  # noqa: F401
from tierserve.model.gguf_quant import quantize_model
from tierserve.model.shapes import ModelShape, preset

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaModel
    shape: ModelShape
    source: str
    """Path the weights came from, or 'dummy:<preset>'."""
    tokenizer_source: str | None
    """Where the tokenizer lives (GGUF file or folder), None for dummy weights."""


def load_model(config: ModelConfig, max_positions: int) -> LoadedModel:
    config.validate()
    dtype, device = DTYPES[config.dtype], torch.device(config.device)
    if config.load_format == "dummy":
        shape = preset(config.model or "smollm2-135m")
        model = _build(shape, max_positions, dtype, device)
        _randomize(model, config.seed)
        quantize_model(model, config.quantization)
        return LoadedModel(model, shape, f"dummy:{shape.name}", config.tokenizer)
    path = model_path(config.model)
    shape, tensors = _open_checkpoint(path, config.load_format)
    model = _build(shape, max_positions, dtype, device)
    load_weights(model, tensors)
    quantize_model(model, config.quantization, path)  # after loading: needs the weights
    return LoadedModel(model, shape, path, config.tokenizer or path)


def _open_checkpoint(path: str, load_format: str):
    if not os.path.exists(path):
        raise ModelLoadError(f"model not found: {path} (give a .gguf file or a Hugging Face "
                             "folder with config.json and *.safetensors)")
    if os.path.isdir(path) and load_format in ("auto", "safetensors"):
        shape = hf_shape(path)
        return shape, _hf_tensors(path)
    if load_format in ("auto", "gguf"):
        ckpt = GGUFCheckpoint(path)
        shape = ckpt.shape()
        return shape, ckpt.tensors(shape)
    raise ConfigError(f"load_format {load_format!r} does not fit {path}")


def _build(shape: ModelShape, max_positions: int, dtype, device) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(shape, max_positions)
    model = model.to_empty(device=device).to(dtype)
    if shape.tie_word_embeddings:  # to_empty unties shared parameters
        model.lm_head.weight = model.embed_tokens.weight
    model.rope = RotaryEmbedding(shape, max_positions).to(device)  # tables stay float32
    if model.rope_local is not None:
        model.rope_local = RotaryEmbedding(shape, max_positions, local=True).to(device)
    return model.eval().requires_grad_(False)


def _randomize(model: LlamaModel, seed: int) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1 and name.endswith("norm"):
            p.fill_(1.0)
        elif p.ndim == 1:
            p.zero_()
        else:
            std = 1.0 / p.shape[-1] ** 0.5
            for i in range(0, p.shape[0], 4096):  # row blocks keep the float32 copy small
                rows = torch.randn(min(4096, p.shape[0] - i), p.shape[1], generator=gen)
                p[i:i + rows.shape[0]].copy_(rows.mul_(std))


def load_weights(model: LlamaModel, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy named HF-layout tensors into the model; fail on any missing weight."""
    shape = model.shape
    q, kv = shape.q_size, shape.kv_size
    inter = shape.intermediate_size
    seen = set()
    for name, t in tensors:
        if name == "rope_freqs":
            model.rope.set_frequency_factors(t)
            continue
        target = _target(model, name, q, kv, inter)
        if target is None:
            continue
        param, start, end = target
        dst = param if start is None else param[start:end]
        if tuple(dst.shape) != tuple(t.shape):
            raise ModelLoadError(f"weight {name} has shape {tuple(t.shape)}, "
                                 f"expected {tuple(dst.shape)}")
        dst.copy_(t)
        seen.add(name)
    missing = [n for n in _expected_names(shape) if n not in seen]
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[0]}")


def _target(model: LlamaModel, name: str, q: int, kv: int, inter: int):
    """(parameter, row start, row end) for an HF tensor name, or None to skip it."""
    if name == "model.embed_tokens.weight":
        return model.embed_tokens.weight, None, None
    if name == "model.norm.weight":
        return model.norm, None, None
    if name == "lm_head.weight":
        return None if model.shape.tie_word_embeddings else (model.lm_head.weight, None, None)
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"]:
        return None
    layer = model.layers[int(parts[2])]
    sub, kind = ".".join(parts[3:-1]), parts[-1]
    rows = {"self_attn.q_proj": (0, q), "self_attn.k_proj": (q, q + kv),
            "self_attn.v_proj": (q + kv, q + 2 * kv),
            "mlp.gate_proj": (0, inter), "mlp.up_proj": (inter, 2 * inter)}
    norms = {"input_layernorm": layer.input_norm, "self_attn.q_norm": layer.attn.q_norm,
             "self_attn.k_norm": layer.attn.k_norm}
    if model.shape.post_norms:  # Gemma: post_attention_layernorm norms the attention output
        norms |= {"post_attention_layernorm": layer.attn_out_norm,
                  "pre_feedforward_layernorm": layer.mlp_norm,
                  "post_feedforward_layernorm": layer.mlp_out_norm}
    else:                       # Llama: post_attention_layernorm is the pre-MLP norm
        norms["post_attention_layernorm"] = layer.mlp_norm
    if norms.get(sub) is not None:
        return norms[sub], None, None
    if sub == "self_attn.o_proj":
        return layer.attn.o_proj.weight, None, None
    if sub == "mlp.down_proj":
        return layer.mlp.down_proj.weight, None, None
    if sub not in rows:
        return None
    if sub.startswith("self_attn."):
        bias = layer.attn.qkv_proj.bias
        param = layer.attn.qkv_proj.weight if kind == "weight" else bias
        return None if param is None else (param, *rows[sub])
    return layer.mlp.gate_up_proj.weight, *rows[sub]


def _expected_names(shape: ModelShape) -> Iterator[str]:
    yield "model.embed_tokens.weight"
    yield "model.norm.weight"
    if not shape.tie_word_embeddings:
        yield "lm_head.weight"
    subs = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
            "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    if shape.qk_norm:
        subs += ["self_attn.q_norm", "self_attn.k_norm"]
    if shape.post_norms:
        subs += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(shape.num_layers):
        for sub in subs:
            yield f"model.layers.{i}.{sub}.weight"


# ------------------------------------------------------------ Hugging Face folders
def _hf_tensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors files")
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as exc:
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from None
