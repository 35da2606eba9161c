"""Tool calling on /v1/chat/completions: `tools` and `tool_choice` validated into a `ToolPlan`,
and the device constraint that makes named and required calls valid by construction
(contract §12 "Tool calls"; docs/serving.md "Tool calls").

    tools:       [{"type": "function", "function": {"name", "description"?, "parameters"?}}]
    tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name": N}}
                 (default "auto" with tools, "none" without)

- named: the output *is* the arguments, generated under the tool's `parameters` schema;
- required: the output is ``{"name":"<name>","arguments":<args>}`` under an `anyOf` of one
  branch per tool (the name a constant, the arguments that tool's schema), compact JSON
  (whitespace pattern ``""``) so the streamed pieces can be cut from it (`serving.tool_calls`);
- auto: free text; Hermes / Qwen ``<tool_call>{...}</tool_call>`` blocks in it become calls;
  where the model writes that format (`serving.chat.call_format_of`) the output runs under
  `auto_regex`: any text, and once a ``<tool_call>`` has started, a call of one of the tools
  (its arguments under its schema) and its ``</tool_call>`` -- valid once started; for a
  Llama 3 template, text or (when it opens with ``{``) one ``{"name", "parameters"}`` call;
- none: free text (the tools are still rendered into the prompt, as vLLM does).

Every `parameters` schema is translated at validation, so a schema the compiler cannot honour
(`jaxdecode.json_schema`) is a 400 naming ``tools``; a bad choice is a 400 naming
``tool_choice``. Named and required cannot be combined with ``response_format``.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from typing import Any, Optional

from jaxdecode.response_format import regex_for, validate_response_format
from serving.protocol import ApiError, bad_request

MODES = ("none", "auto", "required")
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: Optional[str]
    parameters: dict

    def as_openai(self) -> dict:
        """The tool as chat templates take it (OpenAI's shape)."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def schema_format(schema: dict, whitespace: Optional[str] = None) -> dict:
    rf = {"type": "json_schema", "json_schema": {"name": "tool", "schema": schema}}
    if whitespace is not None:
        rf["whitespace_pattern"] = whitespace
    return rf


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """A request's tools and what `tool_choice` makes of them."""

    tools: tuple[Tool, ...]
    mode: str             # "none" | "auto" | "required" | "named"
    name: Optional[str] = None  # the named tool
    auto_pattern: Optional[str] = None  # auto: the `auto_regex` the output runs under

    @property
    def constrained(self) -> bool:
        return self.mode in ("named", "required")

    def tool(self, name: str) -> Optional[Tool]:
        return next((t for t in self.tools if t.name == name), None)

    def response_format(self) -> Optional[dict]:
        """The constraint the engine enforces (None for none / auto)."""
        if self.mode == "named":
            return schema_format(self.tool(self.name).parameters)
        if self.mode == "required":
            return schema_format(required_schema(self.tools), whitespace="")
        if self.auto_pattern is not None:
            return {"type": "regex", "pattern": self.auto_pattern}
        return None

    def templated(self) -> list[dict]:
        return [t.as_openai() for t in self.tools]


def required_schema(tools: tuple[Tool, ...], key: str = "arguments") -> dict:
    """One call of any of `tools`: ``{"name": <const>, key: <its parameters>}``."""
    return {"anyOf": [{"type": "object",
                       "properties": {"name": {"const": t.name}, key: t.parameters},
                       "required": ["name", key], "additionalProperties": False}
                      for t in tools]}


def _class_char(c: str) -> str:
    return "\\" + c if c in "\\]^-[" else c


def text_without(marker: str) -> str:
    """A regex of every text in which `marker` does not occur (its first character must not
    occur again in it): runs of other characters, each occurrence of the first character
    followed by anything that does not complete the marker."""
    first, rest = marker[0], marker[1:]
    assert first not in rest, marker
    other = f"[^{_class_char(first)}]"
    tail = ""  # the text after one `first`, up to the next: not starting with `rest`
    for i, c in reversed(list(enumerate(rest))):
        breaks = f"[^{_class_char(first)}{_class_char(c)}]{other}*"
        tail = f"(?:{breaks})?" if i == len(rest) - 1 else f"(?:{breaks}|{re.escape(c)}{tail})?"
    return f"{other}*(?:{re.escape(first)}{tail})*"


def auto_regex(tools: tuple[Tool, ...], call_format: str = "hermes") -> str:
    """Auto tool calls valid once started (a space allowed after the separators of a call).
    hermes: free text without ``<tool_call>``, and after each ``<tool_call>`` one call of the
    tools (the `required` object) closed by ``</tool_call>``; llama3: after optional
    whitespace, one ``{"name": <tool>, "parameters": <its schema>}`` call, or text that does
    not open with ``{`` (the parser reads a whole output that opens so as a call)."""
    key = "parameters" if call_format == "llama3" else "arguments"
    call = regex_for(validate_response_format(schema_format(required_schema(tools, key), " ?")))
    if call_format == "llama3":
        return rf"\s*(?:(?:{call})\s*|[^{{\s][\s\S]*)?"
    text = text_without("<tool_call>")
    return rf"{text}(?:<tool_call>\n?(?:{call})\n?</tool_call>{text})*"


def _field(obj: dict, key: str, kind: type, where: str, required: bool = True) -> Any:
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise bad_request(f"tools: {where}.{key} must be a {kind.__name__}, got "
                          f"{type(value).__name__}", "tools")
    return value


def parse_tools(tools: Any) -> tuple[Tool, ...]:
    """OpenAI `tools` -> Tools; 400 naming ``tools`` for a bad entry or a schema the compiler
    cannot honour."""
    if not isinstance(tools, list) or not tools:
        raise bad_request("tools: must be a non-empty list of function tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    out, seen = [], set()
    for i, entry in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise bad_request(f"tools: {where} must be {{\"type\": \"function\", "
                              "\"function\": {...}}", "tools")
        function = _field(entry, "function", dict, where)
        name = _field(function, "name", str, f"{where}.function")
        if not _NAME.match(name):
            raise bad_request(f"tools: {where}.function.name must match {_NAME.pattern}, got "
                              f"{name!r}", "tools")
        if name in seen:
            raise bad_request(f"tools: {where}.function.name {name!r} is used twice", "tools")
        seen.add(name)
        description = _field(function, "description", str, f"{where}.function", False)
        parameters = _field(function, "parameters", dict, f"{where}.function", False)
        parameters = EMPTY_PARAMETERS if parameters is None else parameters
        check_schema(schema_format(parameters), f"{where}.function.parameters")
        out.append(Tool(name, description, parameters))
    return tuple(out)


def check_schema(rf: dict, where: str) -> None:
    """The schema translates into a constraint (ValueError -> 400 naming ``tools``)."""
    try:
        regex_for(validate_response_format(rf))
    except ValueError as exc:
        reason = str(exc).removeprefix("response_format: ")
        raise bad_request(f"tools: {where}: {reason}", "tools") from None


def plan_for(tools: Any, tool_choice: Any, response_format: Any,
             call_format: Optional[str] = None) -> Optional[ToolPlan]:
    """The request's ToolPlan (None without tools and tool_choice); 400 naming the field.
    `call_format` ("hermes", "llama3": `serving.chat.call_format_of`): auto runs under that
    format's `auto_regex` (unless the request has its own ``response_format``, or its tools
    cannot be combined into one call schema: then auto calls are parsed only)."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice: needs 'tools'", "tool_choice")
        return None
    parsed = parse_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    name = None
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request("tool_choice: must be 'none', 'auto', 'required' or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                              "tool_choice")
        if name not in {t.name for t in parsed}:
            raise bad_request(f"tool_choice: no tool is named {name!r} (tools: "
                              f"{[t.name for t in parsed]})", "tool_choice")
        mode = "named"
    elif choice in MODES:
        mode = choice
    else:
        raise bad_request(f"tool_choice: must be one of {list(MODES)} or a named function, got "
                          f"{choice!r}", "tool_choice")
    plan = ToolPlan(parsed, mode, name)
    own_format = response_format is not None and response_format.get("type") != "text"
    if mode == "auto" and call_format and not own_format:
        try:
            plan = dataclasses.replace(plan, auto_pattern=auto_regex(parsed, call_format))
        except ValueError:  # e.g. a $ref that no longer resolves inside the anyOf
            pass
    if plan.constrained:
        if own_format:
            raise bad_request(f"tool_choice: {mode} tool calls cannot be combined with "
                              "response_format", "tool_choice")
        if mode == "required":
            check_schema(plan.response_format(), "the tools together")
    return plan


def tools_error(exc: ValueError) -> ApiError:
    """An engine ValueError about the tool constraint (it is our response_format), naming
    ``tools``."""
    return bad_request(f"tools: {str(exc).removeprefix('response_format: ')}", "tools")
