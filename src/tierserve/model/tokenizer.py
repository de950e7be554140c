"""The tokenizer and chat template, from the model's own source, through `transformers`.

A GGUF file carries its vocabulary, merges and chat template in its metadata; transformers
rebuilds a fast tokenizer from them. A Hugging Face folder has tokenizer.json and
tokenizer_config.json. No BPE is written here.
"""

import functools
import os

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
                folder, name = os.path.split(os.path.abspath(source))
                self.hf = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
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
