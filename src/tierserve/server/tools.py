"""Tool calling: the tools rendered into the prompt, the calls parsed out of the output.

NOTE: one way for every model and backend
    Few small models' chat templates render tools (SmolLM2's and Gemma 3's do not), and a
    vLLM replica parses calls only when started with a parser for its model. So tierserve
    does it itself, the same in process and in front of replicas:
    - the tools go into the system message as their JSON definitions, with the answer
      format: a JSON array of calls, [{"name": ..., "arguments": {...}}] (the system
      message the client gave comes first, then this);
    - `required` and a named choice are enforced by a grammar (structured.py states it,
      worker/grammar.py compiles it), so the calls always parse and their arguments always validate against the tool's
      parameters; `auto` lets the model choose, and an answer that parses as calls to the
      given tools is taken as calls; `none` sends no tools;
    - history: an assistant message's `tool_calls` are written back in the same JSON
      format, and a `tool` message is a `tool` turn naming the call it answers.
    A response with calls has `message.tool_calls` and `finish_reason: "tool_calls"`; a
    stream with tools holds its text back until the end (it cannot be known earlier
    whether an `auto` answer is a call) and then sends the calls as OpenAI streams them.
"""

import json
import uuid

from tierserve.errors import InvalidRequestError
from tierserve.structured import GrammarSpec, tool_calls_schema

INSTRUCTIONS = (
    "You can call functions. To call one or more, answer with only a JSON array of calls, "
    'each {"name": <function name>, "arguments": {<arguments>}}, and nothing else. '
    "The functions:\n")


def active(body) -> bool:
    return bool(body.tools) and body.tool_choice != "none"


def chosen_tools(body) -> list[dict]:
    """The tools the model may call: all, or the one a named tool_choice names."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        named = [t for t in tools if t["function"]["name"] == name]
        if not named:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools",
                                      param="tool_choice")
        return named
    return tools


def grammar(body) -> GrammarSpec | None:
    """`required` and named choices: the calls' JSON, enforced token by token."""
    if not active(body) or body.tool_choice in (None, "auto"):
        return None
    one = not body.parallel_tool_calls or isinstance(body.tool_choice, dict)
    schema = tool_calls_schema(chosen_tools(body), parallel=not one)
    if one:  # parallel_tool_calls false, or a named function: exactly one call
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
    return GrammarSpec.json_schema(schema, param="tool_choice")


def render(body) -> list[dict]:
    """The chat as the template takes it (role/content dicts)."""
    out = []
    for m in body.messages:
        if m.role == "assistant" and m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)}
                     for c in m.tool_calls]
            out.append({"role": "assistant", "content": json.dumps(calls)})
        elif m.role == "tool":
            out.append({"role": "tool", "content": f"(result of call {m.tool_call_id}) "
                                                   + m.text()})
        else:
            out.append({"role": m.template_role, "content": m.text()})
    if active(body):
        defs = json.dumps([t["function"] for t in chosen_tools(body)], indent=1)
        system = INSTRUCTIONS + defs
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidRequestError("an assistant tool call's arguments are not JSON",
                                  param="messages") from None


def parse_calls(text: str, body) -> list[dict] | None:
    """OpenAI tool_calls from the model's answer, or None if it is not calls to the tools
    offered (then it is ordinary content)."""
    if not active(body):
        return None
    try:
        calls = json.loads(text.strip())
    except ValueError:
        return None
    if isinstance(calls, dict):
        calls = [calls]
    names = {t["function"]["name"] for t in chosen_tools(body)}
    if not isinstance(calls, list) or not calls or not all(
            isinstance(c, dict) and c.get("name") in names
            and isinstance(c.get("arguments", {}), dict) for c in calls):
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}))}}
            for c in calls]
