"""Tool calling by convention, for chat templates without tool markup (SmolLM2's has none).

Prompt side: when a request has ``tools``, a system message lists them as JSON and asks the model to answer a
call with ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one block per call); it is merged into
the request's own system message when there is one. Earlier assistant calls are rendered the same way and a
``tool`` message keeps its role, with its result as the content.

Output side (``parse_tool_calls``): every ``<tool_call>{json}</tool_call>`` block becomes an OpenAI
``tool_calls`` entry; without blocks, an output that is one JSON object ``{"name", "arguments"}`` (or a list of
them) counts as calls too. A call must name one of the offered tools (the one ``tool_choice`` forces, if any)
and its arguments must be a JSON object (or JSON text of one); anything else stays plain content.
"""

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
INSTRUCTIONS = ("You can call these tools (JSON schemas):\n{tools}\nTo call a tool, answer with "
                '<tool_call>{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}</tool_call> '
                "(one block per call) and nothing else.")


def tool_call_text(name: str, arguments: str | Mapping[str, Any]) -> str:
    """A call as the model is asked to write it (``arguments`` as JSON text or a mapping)."""
    arguments = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def add_tool_instructions(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the tool list in the system message (``tools``: OpenAI ``function`` objects)."""
    listing = "\n".join(json.dumps(dict(tool)) for tool in tools)
    text = INSTRUCTIONS.format(tools=listing)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _as_call(value: Any, allowed: set[str]) -> dict[str, Any] | None:
    if not isinstance(value, dict) or value.get("name") not in allowed:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments)}}


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def parse_tool_calls(text: str, allowed: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content left over or None, OpenAI ``tool_calls``) of a model output; no calls: (text, [])."""
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
