"""The tokenizer and chat template, from the model's own source.

A GGUF file carries its vocabulary, merges and chat template in its metadata; transformers
rebuilds a fast tokenizer from them (about 4 s for SmolLM2's, 12 for Gemma's), and the
result is saved once under the cache folder (~/.cache/tierserve, or TIERSERVE_CACHE_DIR)
so later starts read tokenizer.json in a fraction of a second. A Hugging Face folder has
tokenizer.json and tokenizer_config.json. No BPE is written here.

NOTE: two loaders, one folder
    `Tokenizer` (the engine's) goes through transformers, which imports torch. A fleet
    gateway runs no model and must not load torch (300 MB and seconds of start-up), so
    `Tokenizer.for_gateway` reads the same tokenizer.json with the `tokenizers` library
    (the Rust tokenizer transformers itself runs: the same ids) and renders the chat
    template with jinja2 as transformers does (sandboxed, trim_blocks and lstrip_blocks,
    `raise_exception`, `tojson`, the special tokens as variables). A GGUF file whose
    folder is not cached yet is converted once by transformers in a child process, so
    torch never enters the gateway's.
"""

import functools
import hashlib
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from tierserve.errors import InvalidRequestError, ModelLoadError


class Tokenizer:
    def __init__(self, source: str):
        import transformers

        from tierserve.model.metadata import model_path

        source = model_path(source)  # `gemma3-270m` names a file
        transformers.logging.set_verbosity_error()
        try:
            if os.path.isdir(source):
                self.hf = transformers.AutoTokenizer.from_pretrained(source)
            else:
                self.hf = _from_gguf(source, transformers)
        except Exception as exc:
            raise ModelLoadError(f"cannot load a tokenizer from {source}: {exc}") from None
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.vocab_size = len(self.hf)
        self.all_special_ids = set(self.hf.all_special_ids)

    @staticmethod
    @functools.lru_cache(maxsize=4)
    def load(source: str) -> "Tokenizer":
        """A shared, read-only tokenizer per source (building one from GGUF takes seconds)."""
        return Tokenizer(source)

    @staticmethod
    def for_gateway(source: str) -> "FastTokenizer":
        """The same tokenizer without transformers (and so without torch): see the NOTE."""
        from tierserve.model.metadata import model_path

        source = model_path(source)
        folder = Path(source) if os.path.isdir(source) else cached_folder(source)
        if not (folder / "tokenizer.json").exists():
            if os.path.isdir(source):
                raise ModelLoadError(f"{source} has no tokenizer.json")
            done = subprocess.run([sys.executable, "-m", "tierserve.model.tokenizer", source],
                                  capture_output=True, text=True)
            if done.returncode != 0 or not (folder / "tokenizer.json").exists():
                raise ModelLoadError(f"cannot build a tokenizer from {source}: "
                                     f"{done.stderr.strip()[-300:]}")
        return FastTokenizer(folder)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Plain prompts get the model's BOS if it wants one; templated text has its own."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(token_ids)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.hf.convert_tokens_to_string(tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of the conversation, ending with the assistant's turn opened."""
        if not self.has_chat_template:
            raise InvalidRequestError("this model has no chat template; use a plain prompt",
                                      param="messages")
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=True)
        except Exception as exc:
            raise InvalidRequestError(f"cannot apply the chat template: {exc}",
                                      param="messages") from None
        return self.encode(text, add_special_tokens=False)


def cached_folder(path: str) -> Path:
    """Where the tokenizer built from a GGUF file is kept (keyed by the file's path, size
    and time, and the transformers version that builds it)."""
    path = os.path.abspath(path)
    st = os.stat(path)
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{metadata.version('transformers')}"
    root = Path(os.environ.get("TIERSERVE_CACHE_DIR") or Path.home() / ".cache" / "tierserve")
    return root / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def _from_gguf(path: str, transformers):
    """The tokenizer built from a GGUF file, through the cache folder."""
    cached = cached_folder(path)
    if (cached / "tokenizer.json").exists():
        try:
            return transformers.AutoTokenizer.from_pretrained(str(cached))
        except Exception:    # a partial or foreign folder: build it again below
            pass
    folder, name = os.path.split(os.path.abspath(path))
    hf = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    try:
        tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        hf.save_pretrained(str(tmp))
        os.replace(tmp, cached)      # whole or not at all, even with two servers starting
    except OSError:
        pass                          # a read-only home: build it each start
    return hf


class FastTokenizer:
    """The gateway's tokenizer: tokenizer.json through `tokenizers`, the chat template
    through jinja2 (the NOTE at the top); the methods a gateway uses, as Tokenizer's."""

    def __init__(self, folder: str | Path):
        import jinja2.sandbox
        import tokenizers

        folder = Path(folder)
        self._tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        self._special = {name: _token_text(config.get(name)) for name in
                         ("bos_token", "eos_token", "unk_token", "pad_token")}
        eos = self._special["eos_token"]
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.all_special_ids = {int(i) for i, t in (config.get("added_tokens_decoder") or {})
                                .items() if t.get("special")}
        self._template = None
        if template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
                x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self._template is None:
            raise InvalidRequestError("this model has no chat template; use a plain prompt",
                                      param="messages")
        try:
            text = self._template.render(messages=messages, add_generation_prompt=True,
                                         tools=None, **self._special)
        except Exception as exc:
            raise InvalidRequestError(f"cannot apply the chat template: {exc}",
                                      param="messages") from None
        return self.encode(text, add_special_tokens=False)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json gives it: text, or {"content": text}."""
    return value.get("content") if isinstance(value, dict) else value


def _raise_template_error(message: str):
    raise ValueError(message)


if __name__ == "__main__":  # build and cache the tokenizer of a GGUF file (for_gateway)
    try:
        Tokenizer(sys.argv[1])
    except ModelLoadError as exc:
        sys.exit(f"error: {exc}")
