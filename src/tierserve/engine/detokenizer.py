"""Incremental detokenization with stop strings.

NOTE: never emit broken UTF-8. A byte-level BPE token may hold part of a character. We
decode a short window of tokens twice, without and with the newest ones; the difference is
the new text, and when it ends in U+FFFD (an incomplete character) we emit nothing and
wait for the next token. The window starts a few tokens back (at first in the prompt) so
tokenizers that drop a word's leading space at the start of a decode see the context.

Stop strings are searched in the decoded text across token boundaries. While streaming we
hold back the last (longest stop - 1) characters, since they could be the start of a stop
string; a stop string is never emitted.
"""

from tierserve.model.tokenizer import Tokenizer

_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 stop: list[str], skip_special_tokens: bool = True, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.min_tokens = min_tokens
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_outputs = 0
        self.text = ""
        """Output text so far, cut at a stop string when one matched."""
        self._emitted = 0
        self.stop_reason: str | None = None

    def add_token(self, token_id: int) -> bool:
        """Feed one output token. Returns True when a stop string matched."""
        self._ids.append(token_id)
        self._num_outputs += 1
        window = self._ids[self._prefix_offset:]
        before = self._decode(self._ids[self._prefix_offset:self._read_offset])
        after = self._decode(window)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False
        old_len = len(self.text)
        self.text += after[len(before):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self.stop and self._num_outputs >= self.min_tokens:
            return self._match_stop(old_len)
        return False

    def _match_stop(self, old_len: int) -> bool:
        search_from = max(0, old_len - self._holdback)
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        self.text = self.text[:best[0]]
        self.stop_reason = best[1]
        return True

    def take_delta(self, finished: bool) -> str:
        """Text not yet emitted; holds back a possible stop-string start unless finished."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
