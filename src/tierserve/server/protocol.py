"""Request bodies of the OpenAI API (plus vLLM's extras).

NOTE: no field is ignored
    A client that asked for JSON and silently got prose is worse off than one told no. So:
    a field this server does not know is a 400 naming it (OpenAI's answer to an unknown
    argument); a field of the OpenAI API that is not implemented here is accepted only
    with the value that asks for nothing (`audio: null`, `store: false`, `best_of: 1`)
    and is otherwise a 400 saying it is not supported. Field objects are shared by chat
    and completions so the two never drift apart.

NOTE: no value the engine cannot take
    An integer past what the engine holds (torch.long), or a string that is not Unicode
    (JSON's `"\\ud800"` decodes to a lone surrogate that no tokenizer, database or JSON
    response can encode), is a 400 here rather than a 500 from deep inside. Where the
    engine checks a value itself (a token id against the vocabulary, a prompt's length),
    the OpenAPI document still states the static part of the rule, so that a client or a
    fuzzer built from it sends what is accepted.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tierserve.errors import InvalidRequestError
from tierserve.sampling_params import MAX_LOGPROBS, SamplingParams
from tierserve.structured import GrammarSpec


def _nothing(v: Any) -> bool:
    return v is None or v is False or v == [] or v == {} or v == 0


NOT_SUPPORTED: dict[str, tuple[Any, str]] = {
    # field: (test of the value that asks for nothing, what to say)
    "functions": (_nothing, "function calling is not supported (and deprecated: tools)"),
    "function_call": (lambda v: v in (None, "none"), "function calling is not supported"),
    "audio": (_nothing, "audio output is not supported"),
    "modalities": (lambda v: v in (None, ["text"]), "only text output is supported"),
    "prediction": (_nothing, "predicted outputs are not supported"),
    "reasoning_effort": (_nothing, "this model has no reasoning effort setting"),
    "verbosity": (_nothing, "verbosity is not supported"),
    "web_search_options": (_nothing, "web search is not supported"),
    "store": (_nothing, "stored completions are not supported"),
    "prompt_cache_key": (_nothing, "the prefix cache is automatic here; no key is taken"),
    "best_of": (lambda v: v in (None, 1), "best_of is not supported (use n)"),
    "suffix": (lambda v: v in (None, ""), "suffix (insertion) is not supported"),
}
"""OpenAI fields this server does not implement."""


INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
TOKEN_ID_MAX = 2**31 - 1
"""The largest token id a tokenizer holds (int32); past the model's vocabulary but below
this, the engine answers the 400 (it knows the vocabulary)."""
TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
_TOKENS = {"type": "array", "minItems": 1,
           "items": {"type": "integer", "minimum": 0, "maximum": TOKEN_ID_MAX}}
PROMPT_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1}, _TOKENS,
                           {"type": "array", "minItems": 1,
                            "items": {"type": "string", "minLength": 1}},
                           {"type": "array", "minItems": 1, "items": _TOKENS}]}
"""A prompt as documented: not empty (completions.prompts says so with a clearer message
than pydantic's union errors would)."""


def not_unicode(value: Any, path: tuple = ()) -> str | None:
    """The path (`a.0.b`) of the first string, key or value, in `value` that is not valid
    Unicode; None if all are."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return ".".join(map(str, path)) or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            found = not_unicode(key, path) or not_unicode(item, (*path, key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if found := not_unicode(item, (*path, i)):
                return found
    return None


class UnicodeBody(BaseModel):
    """A request body whose strings must all be valid Unicode (see the module's note)."""

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        if (param := not_unicode(data)) is not None:
            raise InvalidRequestError(f"{param}: a string is not valid Unicode (a lone "
                                      "surrogate escape such as \\ud800)", param=param)
        return data


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _StrictBody(UnicodeBody):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


SAMPLING_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                      "max_tokens")
"""Request fields a model's generation defaults fill where the request gives none."""


class _Request(_StrictBody):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    user: str | None = None
    """Recorded in the ledger's tags, as `user`."""
    safety_identifier: str | None = None
    """Recorded in the ledger's tags, as `safety_identifier`."""
    metadata: dict[str, str] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[TokenId, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, json_schema_extra={"propertyNames": {"pattern": "^[0-9]{1,9}$"}})
    # vLLM-style extras
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    """vLLM's field: requests share cached prefix blocks only when their tenant's cache
    group and this salt are equal."""
    # structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name in set(data) & set(NOT_SUPPORTED):
            asks_nothing, why = NOT_SUPPORTED[name]
            if not asks_nothing(data[name]):
                raise InvalidRequestError(f"{name} is not supported: {why}", param=name,
                                          code="unsupported_parameter")
        return {k: v for k, v in data.items() if k not in NOT_SUPPORTED}

    def sampling_params(self, choice: int = 0, defaults: dict | None = None) -> SamplingParams:
        """Choice i of n gets seed + i, so n choices differ but each is reproducible.
        `defaults`: the model's sampling defaults (model/generation.py), for the fields
        this request does not give; those fields are named in `defaulted`."""
        d = defaults or {}
        given = self.model_fields_set
        unset = [f for f in SAMPLING_DEFAULTED
                 if f not in given or getattr(self, f) is None]
        if self.max_completion_tokens is not None:
            unset = [f for f in unset if f != "max_tokens"]

        def pick(name, fallback):
            return d.get(name, fallback) if name in unset else getattr(self, name)

        return SamplingParams(
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0) or 0,
            max_tokens=self.max_completion_tokens or pick("max_tokens", None),
            defaulted=frozenset(unset),
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=list(self.stop_token_ids or []),
            seed=None if self.seed is None else self.seed + choice,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            min_p=pick("min_p", 0.0),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=dict(self.logit_bias or {}),
            grammar=self.grammar_spec(),
            logprobs=self.num_logprobs)

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token to return (None: no logprobs)."""
        return None

    def grammar_spec(self) -> GrammarSpec | None:
        return GrammarSpec.from_request(
            self.response_format, self.guided_json, self.guided_regex, self.guided_choice,
            self.guided_grammar, self.structured_outputs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def tags(self) -> dict[str, str]:
        """What the ledger records with the request: metadata, user, safety_identifier."""
        ids = {k: v for k, v in (("user", self.user),
                                 ("safety_identifier", self.safety_identifier)) if v}
        return {**(self.metadata or {}), **ids}


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str
    """JSON text, as OpenAI sends it."""


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Strict):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None
    """Arguments are always checked against `parameters` when the grammar forces a call."""


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, json_schema_extra={"maxLength": 0})
    """Not supported: only an empty name is accepted."""
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("name")
    @classmethod
    def _no_names(cls, v):
        if v:  # chat templates have no place for it: it would be dropped
            raise ValueError("message names are not supported by this model's template")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    @property
    def template_role(self) -> str:
        """`developer` is the newer name of `system` (OpenAI's reasoning models)."""
        return "system" if self.role == "developer" else self.role


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        if isinstance(self.tool_choice, dict) and not (
                self.tool_choice.get("type") == "function"
                and isinstance(self.tool_choice.get("function"), dict)):
            raise InvalidRequestError('tool_choice must be "none", "auto", "required" or '
                                      '{"type": "function", "function": {"name": ...}}',
                                      param="tool_choice")
        return self

    def grammar_spec(self) -> GrammarSpec | None:
        from tierserve.server import tools
        forced, asked = tools.grammar(self), super().grammar_spec()
        if forced is not None and asked is not None:
            raise InvalidRequestError("a required or named tool_choice cannot be combined "
                                      "with response_format", param="tool_choice")
        return forced or asked

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:  # OpenAI's rule
            raise InvalidRequestError("top_logprobs needs logprobs: true",
                                      param="top_logprobs")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        json_schema_extra=lambda schema: schema.update(PROMPT_SCHEMA))
    echo: bool = False
    """The prompt's text ahead of each choice's text."""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _no_prompt_logprobs(self):
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError("logprobs with echo (the prompt's logprobs) are not "
                                      "supported", param="logprobs",
                                      code="unsupported_parameter")
        return self

    @model_validator(mode="after")
    def _token_ids_in_range(self):
        """Before `echo` decodes them, which a tokenizer cannot do past int32."""
        p = self.prompt
        if isinstance(p, list):
            ids = [p] if p and isinstance(p[0], int) else [x for x in p if isinstance(x, list)]
            if any(not 0 <= t <= TOKEN_ID_MAX for x in ids for t in x):
                raise InvalidRequestError(f"prompt token ids must be integers in "
                                          f"[0, {TOKEN_ID_MAX}]", param="prompt")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeRequest(_StrictBody):
    """vLLM's /tokenize: a text, or a chat rendered with the model's template."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages",
                                      param="prompt")
        return self


class DetokenizeRequest(_StrictBody):
    model: str
    tokens: list[int]
