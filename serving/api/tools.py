"""Tool calling by convention, for chat templates without tool markup (SmolLM2's has none), shared by the
OpenAI and Anthropic routes.

Prompt side: when a request has ``tools``, a system message lists them as JSON (``{"name", "description",
"parameters"}``) and asks the model to answer a call with ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` (one block per call); it is merged into the request's own system message when there is one.
Earlier assistant calls are rendered the same way and a tool result is a ``tool`` message, with the result as
its content.

Output side (``ToolCallStream`` as the output streams, ``parse_tool_calls`` for a whole one): every
``<tool_call>{json}</tool_call>`` block is a call; an output that is one JSON object ``{"name", "arguments"}``
(or a list of them) counts as calls too. A call must name one of the offered tools (the one ``tool_choice``
forces, if any) and its arguments must be a JSON object (or JSON text of one); anything else stays plain
content. Text streams as it comes; a call is sent once it is whole.

Forced tool choice (OpenAI "required" or a named function, Anthropic "any" or "tool"): ``call_schema`` is the
JSON schema of a bare call object (or, with parallel calls, a list of 1 to MAX_PARALLEL_CALLS), which constrains
the output (``serving.structured``), so it always parses into calls whose arguments follow the tool's schema,
with no keys beyond the declared ones (``_bounded_arguments``). Identical calls are sent once; an output cut by
``max_tokens`` keeps the calls it completed.
"""

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from serving.api.errors import APIError
from serving.structured import InvalidConstraintError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_PARALLEL_CALLS = 8  # calls one forced answer may hold: a small model repeats a call until max_tokens
MAX_OPEN_ARGUMENTS = 16  # keys a forced call's arguments may have when its schema declares none
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


def _bounded_arguments(parameters: dict[str, Any]) -> dict[str, Any]:
    """The schema a forced call's arguments are generated under: ``parameters`` with its declared properties as
    the only keys when it declares some and does not say ``additionalProperties`` (a tool function takes the
    arguments it declares: LangChain's and pydantic's schemas leave the key out, and a small model then invents
    keys until ``max_tokens``), and at most MAX_OPEN_ARGUMENTS keys when it declares none."""
    if "additionalProperties" in parameters or "patternProperties" in parameters:
        return parameters
    if parameters.get("properties"):
        return {**parameters, "additionalProperties": False}
    return {"maxProperties": MAX_OPEN_ARGUMENTS, **parameters}


def call_schema(tools: Sequence[Mapping[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of an output that is one call of one of ``tools`` (``{"name", "parameters"}`` objects),
    or with ``parallel`` a list of 1 to MAX_PARALLEL_CALLS calls; arguments follow ``_bounded_arguments``.

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
        calls.append({"type": "object", "properties": {"name": {"const": tool["name"]},
                                                       "arguments": _bounded_arguments(parameters)},
                      "required": ["name", "arguments"], "additionalProperties": False})
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": call, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS} if parallel else call
    return schema | {key: value for key, value in defs.items() if value}


def _as_call(value: Any, allowed: set[str]) -> Call | None:
    if not isinstance(value, dict) or value.get("name") not in allowed:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return None
    return Call(value["name"], arguments) if isinstance(arguments, dict) else None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _partial_tag(text: str) -> int:
    """Where the longest suffix of ``text`` that could begin an OPEN tag starts (``len(text)`` if none)."""
    for start in range(max(0, len(text) - len(OPEN) + 1), len(text)):
        if OPEN.startswith(text[start:]):
            return start
    return len(text)


class ToolCallStream:
    """Splits a model's output into content and calls as it streams (``feed`` each new piece of text, then
    ``finish``), so that text streams at once even with tools offered and each call is sent when it is whole.

    Two forms (the module docstring): text with ``<tool_call>{json}</tool_call>`` blocks (text streams up to
    anything that may begin a block; a block that is not a call of an allowed tool stays content), or an output
    that is one JSON value (its first non-blank character ``{`` or ``[``): each whole call of a list is sent as
    soon as it closes, so a forced answer cut by ``max_tokens`` keeps the calls it completed. A JSON output
    without any call is content. A call identical to an earlier one (same name and arguments) is dropped.
    """

    def __init__(self, allowed: set[str]):
        self.allowed = allowed
        self.calls: list[Call] = []
        self._pending = ""  # text not yet given out
        self._form: Literal["text", "object", "list"] | None = None  # None: only blanks so far
        self._closed = False  # the JSON value is complete: what follows is content

    def _call(self, call: Call) -> list[Call]:
        if call in self.calls:
            return []
        self.calls.append(call)
        return [call]

    def feed(self, text: str) -> list[str | Call]:
        """Content pieces and calls that ``text``, appended to the output so far, completes, in order."""
        self._pending += text
        if self._form is None:
            head = self._pending.lstrip()
            if not head:
                return []
            self._form = {"{": "object", "[": "list"}.get(head[0], "text")
            if self._form != "text":
                self._pending = head
        if self._form == "text" or self._closed:
            return self._text()
        return self._json()

    def _text(self) -> list[str | Call]:
        events: list[str | Call] = []
        while True:
            start = self._pending.find(OPEN)
            if start < 0:
                cut = _partial_tag(self._pending)
                if cut:
                    events.append(self._pending[:cut])
                self._pending = self._pending[cut:]
                return events
            end = self._pending.find(CLOSE, start)
            if start:
                events.append(self._pending[:start])
            if end < 0:
                self._pending = self._pending[start:]
                return events
            block = self._pending[start:end + len(CLOSE)]
            call = _as_call(_loads(block[len(OPEN):-len(CLOSE)].strip()), self.allowed)
            events.extend(self._call(call) if call else [block])
            self._pending = self._pending[end + len(CLOSE):]

    def _json(self) -> list[str | Call]:
        """Whole calls at the front of a JSON output; the output stays pending while it may still be calls."""
        decoder = json.JSONDecoder()
        if self._form == "object":
            try:
                value, end = decoder.raw_decode(self._pending)
            except json.JSONDecodeError:
                return []
            call = _as_call(value, self.allowed)
            if call is None:  # a JSON answer, not a call: content
                self._form, self._closed = "text", True
                return self._text()
            self._closed, self._pending = True, self._pending[end:].lstrip()
            return [*self._call(call), *self._text()]
        events: list[str | Call] = []
        position = 1  # after "["
        while True:
            rest = self._pending[position:].lstrip(" \t\r\n,")
            position = len(self._pending) - len(rest)
            if rest.startswith("]"):
                if not self.calls:  # a JSON list without calls: content
                    self._form, self._closed = "text", True
                    return self._text()
                self._closed, self._pending = True, rest[1:].lstrip()
                return [*events, *self._text()]
            try:
                value, end = decoder.raw_decode(self._pending, position)
            except json.JSONDecodeError:
                break
            call = _as_call(value, self.allowed)
            if call is None:
                self._form, self._closed = "text", True
                return [*events, *self._text()]
            events += self._call(call)
            self._pending, position = "[" + self._pending[end:], 1
        return events

    def finish(self) -> list[str | Call]:
        """What is left once the output is complete: pending text as content, or nothing when it is the cut-off
        rest of a JSON list whose earlier calls were given out."""
        rest, self._pending = self._pending, ""
        if self._form in ("object", "list") and not self._closed and self.calls:
            return []
        return [rest] if rest else []


def parse_tool_calls(text: str, allowed: set[str]) -> tuple[str | None, list[Call]]:
    """(content or None, calls) of a whole model output, as ``ToolCallStream`` splits it; the content stripped
    (None when blank) when there are calls; no calls: (text, [])."""
    stream = ToolCallStream(allowed)
    events = [*stream.feed(text), *stream.finish()]
    if not stream.calls:
        return text, []
    content = "".join(e for e in events if isinstance(e, str)).strip()
    return content or None, stream.calls
