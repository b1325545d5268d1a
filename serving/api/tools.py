"""Tool calling by convention, for chat templates without tool markup (SmolLM2's has none), shared by the
OpenAI and Anthropic routes.

Prompt side: when a request has ``tools``, a system message lists them as JSON (``{"name", "description",
"parameters"}``) and asks the model to answer a call with ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` (one block per call); it is merged into the request's own system message when there is one.
Earlier assistant calls are rendered the same way and a tool result is a ``tool`` message, with the result as
its content.

Output side (``parse_tool_calls``): every ``<tool_call>{json}</tool_call>`` block is a call; without blocks, an
output that is one JSON object ``{"name", "arguments"}`` (or a list of them) counts as calls too. A call must
name one of the offered tools (the one ``tool_choice`` forces, if any) and its arguments must be a JSON object
(or JSON text of one); anything else stays plain content.

Forced tool choice (OpenAI "required" or a named function, Anthropic "any" or "tool"): ``call_schema`` is the
JSON schema of a bare call object (or a non-empty list of them), which constrains the output
(``serving.structured``), so it always parses into calls whose arguments follow the tool's schema.
"""

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from serving.api.errors import APIError
from serving.structured import InvalidConstraintError

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
INSTRUCTIONS = ("You can call these tools (JSON schemas):\n{tools}\nTo call a tool, answer with "
                '<tool_call>{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}</tool_call> '
                "(one block per call) and nothing else.")
DEFS_KEYS = ("$defs", "definitions")  # where a schema keeps the subschemas its "$ref"s name


class Call(NamedTuple):
    """A tool call parsed from a model's output."""

    name: str
    arguments: dict[str, Any]


def tool_call_text(name: str, arguments: str | Mapping[str, Any], where: str = "arguments") -> str:
    """A call as the model is asked to write it (``arguments`` as JSON text of an object, or a mapping); 400
    naming ``where`` (the request field) when the text is not a JSON object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError) as e:
            raise APIError(400, f"{where}: {arguments!r:.200} is not valid JSON: {e}", where) from None
        if not isinstance(arguments, dict):
            raise APIError(400, f"{where}: expected the JSON text of an object, got {arguments!r:.200}", where)
    arguments = dict(arguments)
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def add_tool_instructions(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the tool list in the system message (``tools``: ``{"name", "description",
    "parameters"}`` objects, as OpenAI's ``function``)."""
    listing = "\n".join(json.dumps(dict(tool)) for tool in tools)
    text = INSTRUCTIONS.format(tools=listing)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def offer_tools(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                choice: Literal["auto", "none", "required"], name: str | None = None
                ) -> tuple[list[dict[str, Any]], set[str] | None, list[dict[str, Any]] | None]:
    """(``messages`` with the tools offered, the tool names a call may use or None, the tools the output must
    call or None) of a request's ``tools`` and tool choice: "required" forces a call (``name``'s, when given).
    400 (param "tool_choice") for a forced call without tools or a ``name`` that is not one of them."""
    if choice == "required" and not tools:
        raise APIError(400, "tool_choice forces a tool call but the request has no tools", "tool_choice")
    if not tools or choice == "none":
        return messages, None, None
    allowed = {tool["name"] for tool in tools}
    if name is not None:
        if name not in allowed:
            raise APIError(400, f"tool_choice names {name!r}: expected one of {sorted(allowed)}", "tool_choice")
        allowed = {name}
    offered = [tool for tool in tools if tool["name"] in allowed]
    return add_tool_instructions(messages, offered), allowed, offered if choice == "required" else None


def call_schema(tools: Sequence[Mapping[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of an output that is one call of one of ``tools`` (``{"name", "parameters"}`` objects),
    or with ``parallel`` a non-empty list of calls.

    Each tool's ``$defs`` / ``definitions`` move to the root, where its ``$ref``s point. InvalidConstraintError
    for parameters that are not an object schema, or two tools defining one subschema name differently.
    """
    calls, defs = [], {key: {} for key in DEFS_KEYS}
    for tool in tools:
        parameters = dict(tool.get("parameters") or {"type": "object"})
        if parameters.get("type", "object") != "object":
            raise InvalidConstraintError(f"tool {tool['name']!r} has parameters of type {parameters['type']!r}: "
                                         f"expected an object schema")
        for key in DEFS_KEYS:
            for name, subschema in parameters.pop(key, {}).items():
                if defs[key].setdefault(name, subschema) != subschema:
                    raise InvalidConstraintError(f"tools define {key} {name!r} differently: expected one meaning")
        calls.append({"type": "object", "properties": {"name": {"const": tool["name"]}, "arguments": parameters},
                      "required": ["name", "arguments"], "additionalProperties": False})
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": call, "minItems": 1} if parallel else call
    return schema | {key: value for key, value in defs.items() if value}


def _as_call(value: Any, allowed: set[str]) -> Call | None:
    if not isinstance(value, dict) or value.get("name") not in allowed:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return Call(value["name"], arguments) if isinstance(arguments, dict) else None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def parse_tool_calls(text: str, allowed: set[str]) -> tuple[str | None, list[Call]]:
    """(content left over or None, calls) of a model output; no calls: (text, [])."""
    blocks = TOOL_CALL.findall(text)
    if blocks:
        calls = [_as_call(_json(block), allowed) for block in blocks]
        if all(calls):
            rest = TOOL_CALL.sub("", text).strip()
            return rest or None, calls
        return text, []
    value = _json(text.strip())
    values = value if isinstance(value, list) and value else [value]
    calls = [_as_call(v, allowed) for v in values]
    return (None, calls) if all(calls) else (text, [])
