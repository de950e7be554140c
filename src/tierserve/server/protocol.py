"""Request bodies of the OpenAI API (plus vLLM's extras). Unknown fields are ignored.

Field objects are shared by chat and completions so the two never drift apart.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tierserve.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    # vLLM-style extras
    priority: int = 0
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False

    def sampling_params(self, choice: int = 0) -> SamplingParams:
        """Choice i of n gets seed + i, so n choices differ but each is reproducible."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            max_tokens=self.max_completion_tokens or self.max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            seed=None if self.seed is None else self.seed + choice,
            ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
