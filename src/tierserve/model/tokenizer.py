"""The tokenizer and chat template, from the model's own source, through `transformers`.

A GGUF file carries its vocabulary, merges and chat template in its metadata; transformers
rebuilds a fast tokenizer from them (about 4 s for SmolLM2's, 12 for Gemma's), and the
result is saved once under the cache folder (~/.cache/tierserve, or TIERSERVE_CACHE_DIR)
so later starts read tokenizer.json in a fraction of a second. A Hugging Face folder has
tokenizer.json and tokenizer_config.json. No BPE is written here.
"""

import functools
import hashlib
import os
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


def _from_gguf(path: str, transformers):
    """The tokenizer built from a GGUF file, through the cache folder (keyed by the file's
    path, size and time, and the transformers version that built it)."""
    path = os.path.abspath(path)
    st = os.stat(path)
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    root = Path(os.environ.get("TIERSERVE_CACHE_DIR") or Path.home() / ".cache" / "tierserve")
    cached = root / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]
    if (cached / "tokenizer.json").exists():
        try:
            return transformers.AutoTokenizer.from_pretrained(str(cached))
        except Exception:    # a partial or foreign folder: build it again below
            pass
    folder, name = os.path.split(path)
    hf = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    try:
        tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        hf.save_pretrained(str(tmp))
        os.replace(tmp, cached)      # whole or not at all, even with two servers starting
    except OSError:
        pass                          # a read-only home: build it each start
    return hf
