"""What a request constrains its output to (structured output), as plain data: the
`GrammarSpec` of an OpenAI or vLLM request body and the schema of tool calls.

Torch-free and llguidance-free, so the HTTP layer and a fleet gateway (which runs no
model) can parse and pass constraints on; compiling them into token masks is
worker/grammar.py's.
"""

import json
from dataclasses import dataclass, field, replace

from tierserve.errors import InvalidRequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to; hashable, the key of the compile cache."""

    kind: str
    """One of KINDS."""
    value: str | tuple[str, ...] | None = None
    """The schema as JSON text, the regex, the choices, or the grammar (Lark or GBNF)."""
    param: str = field(default="response_format", compare=False)
    """The request field it came from, named in errors; not part of the cache key."""
    whitespace: str | None = None
    """JSON kinds: None for compact JSON (no free whitespace, `,` and `:` alone, as
    OpenAI writes it), else the regex of whitespace allowed at each gap (vLLM's
    `structured_outputs.whitespace_pattern`)."""

    @classmethod
    def json_schema(cls, schema: dict | str, param: str = "response_format") -> "GrammarSpec":
        """A schema given as a dict or text; text is re-serialised so that spacing does not
        split the cache (key order is kept: it is the order properties are generated in)."""
        try:
            obj = json.loads(schema) if isinstance(schema, str) else schema
            text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}",
                                      param=param) from None
        if not isinstance(obj, dict):
            raise InvalidRequestError("a JSON schema must be an object", param=param)
        return cls("json_schema", text, param)

    @classmethod
    def from_request(cls, response_format: dict | None = None, guided_json=None,
                     guided_regex: str | None = None, guided_choice: list | None = None,
                     guided_grammar: str | None = None,
                     structured_outputs: dict | None = None) -> "GrammarSpec | None":
        """The constraint of an OpenAI / vLLM request body, or None; at most one may be set.

        response_format: {"type": "text" | "json_object"} or {"type": "json_schema",
        "json_schema": {"name", "schema", "strict"}} (the schema is enforced whether or
        not strict is set, as vLLM does). vLLM's guided_* fields and its newer
        `structured_outputs` object ({"json" | "regex" | "choice" | "grammar" |
        "json_object": ...}) map onto the same kinds.
        """
        found = []
        if response_format and response_format.get("type", "text") != "text":
            found.append(_from_response_format(response_format))
        guided = {"json": guided_json, "regex": guided_regex, "choice": guided_choice,
                  "grammar": guided_grammar}
        found += [_from_guided(key, value, f"guided_{key}")
                  for key, value in guided.items() if value is not None]
        options = dict(structured_outputs or {})
        pattern = options.pop("whitespace_pattern", None)
        for key, value in options.items():
            if value is not None and value is not False:
                found.append(_from_guided(key, value, "structured_outputs"))
        if len(found) > 1:
            raise InvalidRequestError("set at most one of response_format, guided_* and "
                                      "structured_outputs", param=found[1].param)
        if pattern is None:
            return found[0] if found else None
        if not isinstance(pattern, str) or not found or \
                found[0].kind not in ("json_schema", "json_object"):
            raise InvalidRequestError("structured_outputs.whitespace_pattern must be a regex "
                                      "string, beside a JSON constraint",
                                      param="structured_outputs.whitespace_pattern")
        return replace(found[0], whitespace=pattern)

    def to_vllm(self) -> dict:
        """The same constraint as vLLM's `structured_outputs` object (what a replica in
        fleet mode is sent; a tierserve replica reads it too)."""
        space = {} if self.whitespace is None else {"whitespace_pattern": self.whitespace}
        if self.kind == "json_schema":
            return {"json": json.loads(self.value), **space}
        if self.kind == "json_object":
            return {"json_object": True, **space}
        return {self.kind: list(self.value) if self.kind == "choice" else self.value}


def _from_response_format(fmt: dict) -> GrammarSpec:
    kind = fmt.get("type")
    if kind == "json_object":
        return GrammarSpec("json_object", None)
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if schema is None:
            raise InvalidRequestError("response_format json_schema needs json_schema.schema",
                                      param="response_format")
        return GrammarSpec.json_schema(schema)
    raise InvalidRequestError(f"unknown response_format type {kind!r}; expected text, "
                              "json_object or json_schema", param="response_format")


def _from_guided(key: str, value, param: str) -> GrammarSpec:
    if key == "json":
        return GrammarSpec.json_schema(value, param=param)
    if key == "json_object":
        return GrammarSpec("json_object", None, param)
    if key == "choice":
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise InvalidRequestError("choices must be a list of strings", param=param)
        return GrammarSpec("choice", tuple(value), param)
    if key in ("regex", "grammar"):
        if not isinstance(value, str):
            raise InvalidRequestError(f"{key} must be a string", param=param)
        return GrammarSpec(key, value, param)
    raise InvalidRequestError(f"unsupported structured output {key!r}", param=param)


def tool_calls_schema(tools: list[dict], parallel: bool = True) -> dict:
    """A JSON schema for tool calls: {"name": <one of the tools>, "arguments": <that
    tool's parameters>}, or a non-empty list of them when `parallel`. `tools` are OpenAI
    tool objects ({"type": "function", "function": {"name", "parameters"}})."""
    calls = []
    for tool in tools:
        fn = tool.get("function", tool)
        calls.append({"type": "object",
                      "properties": {"name": {"const": fn["name"]},
                                     "arguments": fn.get("parameters") or {"type": "object"}},
                      "required": ["name", "arguments"], "additionalProperties": False})
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": one, "minItems": 1} if parallel else one
