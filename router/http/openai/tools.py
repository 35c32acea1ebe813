"""OpenAI's `tools` and `tool_choice` on chat, served as TGI serves them: the offered functions
become one JSON-Schema grammar, so the model can only answer with
`{"function": {"_name": <a function>, <its arguments>...}}`, and the prompt carries the tools
(the chat template's `tools` variable when it uses one, TGI's text appended to the last message
otherwise). `tool_choice: "auto"` adds TGI's `no_tool` function, whose `content` is the answer
when the model chooses to call nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from pytgi_router.core.errors import ValidationError
from pytgi_router.http.http_errors import ToolError

NO_TOOL = "no_tool"

# TGI's `tool_prompt` default, word for word.
DEFAULT_TOOL_PROMPT = (
    "Given the functions available, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt. Respond in the format {name: function "
    "name, parameters: dictionary of argument name and its value}.Do not use variables."
)

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

# Where the grammar keeps each function's closed object (`_name` first) and each tool's own
# parameters schema, whole: the tool's local references (`#/$defs/X`, `#/properties/a`, `#`) are
# moved under its `$parameters` entry, so that each resolves within its own tool (two tools may
# both define `$defs/X`).
FUNCTIONS = "$functions"
PARAMETERS = "$parameters"

# Keywords whose values are data, not schemas: a `{"$ref": ...}` inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names (not keywords) to schemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})
# What a URI fragment may hold unencoded besides letters, digits and `-._~` (RFC 3986 pchar):
# anything else in a name (`%`, a space, a quote, non-ASCII) is percent-encoded, as llguidance
# and jsonschema decode fragments before they read the pointer.
_FRAGMENT_SAFE = "!$&'()*+,;=:@"


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The OpenAI form, as chat templates (transformers' convention) expect it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


NO_TOOL_FUNCTION = Tool(
    NO_TOOL,
    "Open ended response with no specific tool selected",
    {
        "type": "object",
        "properties": {"content": {"type": "string", "description": "The response content"}},
        "required": ["content"],
    },
)


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """"auto" | "none" | "required" | "function" (then `name` says which)."""

    kind: str
    name: str | None = None


AUTO = ToolChoice("auto")


def parse_tools(value: Any) -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValidationError("`tools` must be an array of tools")
    tools = [_tool(t, i) for i, t in enumerate(value)]
    _check_unique(tools)
    return tools


def _check_unique(tools: list[Tool]) -> None:
    """The grammar and the answer name a function by its name alone: two tools of one name
    would be one function whose schema is either's."""
    first: dict[str, int] = {}
    for i, tool in enumerate(tools):
        j = first.setdefault(tool.name, i)
        if j != i:
            raise ValidationError(
                f"`tools[{i}].function.name` {tool.name!r} is already the name of `tools[{j}]`: "
                "function names must be unique"
            )


def _tool(value: Any, i: int) -> Tool:
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(function, dict):
        raise ValidationError(f"`tools[{i}]` must be {{\"type\": \"function\", \"function\": {{...}}}}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValidationError(f"`tools[{i}].function.name` must be a non-empty string")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValidationError(f"`tools[{i}].function.description` must be a string")
    # TGI reads `arguments` as an alias of `parameters`.
    parameters = function.get("parameters", function.get("arguments"))
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise ValidationError(f"`tools[{i}].function.parameters` must be a JSON schema object")
    return Tool(name, description, parameters)


def parse_tool_choice(value: Any) -> ToolChoice:
    """TGI's forms: "auto" (the default), "none", "required", a bare function name, or
    `{"type": "function", "function": {"name": ...}}`."""
    if value is None:
        return AUTO
    if isinstance(value, str):
        return ToolChoice(value) if value in ("auto", "none", "required") else ToolChoice(
            "function", value)
    if isinstance(value, dict):
        function = value.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return ToolChoice("function", function["name"])
    raise ValidationError(
        '`tool_choice` must be "auto", "none", "required" or {"type": "function", '
        '"function": {"name": ...}}'
    )


@dataclass(frozen=True, slots=True)
class ChatTools:
    """The functions one chat request offers the model (with `no_tool` under "auto") and the
    tool prompt."""

    tools: list[Tool]
    prompt: str

    def template_tools(self) -> list[dict[str, Any]]:
        return [t.openai() for t in self.tools]

    def prompt_suffix(self, template_uses_tools: bool) -> str:
        """TGI's text for the last message: the tool prompt, preceded by the tools as JSON
        when the template does not render them itself."""
        if template_uses_tools:
            return f"\n---\n{self.prompt}"
        tools = json.dumps(self.template_tools(), ensure_ascii=False)
        return f"\n---\n{tools}\n{self.prompt}"

    def names(self) -> frozenset[str]:
        """The functions the grammar lets the model name (`no_tool` among them under "auto")."""
        return frozenset(t.name for t in self.tools)

    def grammar(self) -> dict[str, Any]:
        """TGI's tool grammar: `$functions` (each with a required `_name` const first, then its
        own properties, closed) and `function` as an `anyOf` of references to them. The root is
        a required, closed object too, so `{}` is not an answer. Each tool's parameters sit
        whole under `$parameters`, where its own references resolve."""
        functions = {t.name: _function_schema(t) for t in self.tools}
        parameters = {t.name: _scoped_parameters(t) for t in self.tools}
        refs = [{"$ref": _ref(FUNCTIONS, t.name)} for t in self.tools]
        schema: dict[str, Any] = {
            FUNCTIONS: functions,
            PARAMETERS: parameters,
            "type": "object",
            "properties": {"function": {"anyOf": refs}},
            "required": ["function"],
            "additionalProperties": False,
        }
        return {"type": "json", "value": schema}


def _function_schema(tool: Tool) -> dict[str, Any]:
    """The closed object the model writes for `tool`: `_name`, then each of its properties as a
    reference to the property in the tool's own (scoped) parameters."""
    props = tool.parameters.get("properties")
    required = tool.parameters.get("required")
    properties: dict[str, Any] = {"_name": {"type": "string", "const": tool.name}}
    if isinstance(props, dict):
        base = _ref(PARAMETERS, tool.name)
        properties.update({p: {"$ref": f"{base}/properties/{_token(p)}"} for p in props})
    out: dict[str, Any] = {"type": "object"}
    if tool.description is not None:
        out["description"] = tool.description
    out["properties"] = properties
    out["required"] = ["_name", *(required if isinstance(required, list) else [])]
    out["additionalProperties"] = False
    return out


def _scoped_parameters(tool: Tool) -> dict[str, Any]:
    """The tool's parameters as the grammar's subschema at `#/$parameters/<name>`, its local
    references moved there. Its root `$id` (which would make them relative to itself again) and
    `$schema` (a root-only keyword) are dropped."""
    root = {k: v for k, v in tool.parameters.items() if k not in ("$id", "$schema")}
    return _rebased(root, _ref(PARAMETERS, tool.name))


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with every local `$ref` (`#` or `#/...`) moved under `base`. Data (`enum`,
    `const`...) is copied as is, and so is a subschema with its own `$id`: its references are
    relative to itself."""
    if isinstance(schema, list):
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, dict) or "$id" in schema:
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(s, base) for name, s in value.items()}
        elif key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        else:
            out[key] = _rebased(value, base)
    return out


def _ref(section: str, name: str) -> str:
    """The reference to `name`'s entry in a section of the grammar's root."""
    return f"#/{section}/{_token(name)}"


def _token(name: str) -> str:
    """`name` as one token of a JSON pointer (RFC 6901: `~` and `/` escaped) inside a URI
    fragment (percent-encoded, so that `a%20b` stays `a%20b` once decoded)."""
    escaped = name.replace("~", "~0").replace("/", "~1")
    return quote(escaped, safe=_FRAGMENT_SAFE)


def chat_tools(
    tools: list[Tool], choice: ToolChoice, tool_prompt: str | None
) -> ChatTools | None:
    """What `tool_choice` offers: None (no grammar, no tools in the prompt) for "none" or no
    tools; one named function; all of them ("required"); all plus `no_tool` ("auto")."""
    if not tools or choice.kind == "none":
        return None
    if choice.kind == "function":
        chosen = [t for t in tools if t.name == choice.name]
        if not chosen:
            raise ToolError(f"Tool with name {choice.name} not found")
        offered = chosen[:1]
    elif choice.kind == "required":
        offered = list(tools)
    else:
        offered = [*tools, NO_TOOL_FUNCTION]
    return ChatTools(offered, DEFAULT_TOOL_PROMPT if tool_prompt is None else tool_prompt)


def with_tool_prompt(messages: list[dict[str, Any]], suffix: str) -> list[dict[str, Any]]:
    """A copy of the conversation with `suffix` appended to the last message's content (TGI)."""
    if not messages:
        return messages
    last = dict(messages[-1])
    content = last.get("content") or ""
    if isinstance(content, list):  # parts with images: the suffix is one more text part
        last["content"] = [*content, {"type": "text", "text": suffix}]
    else:
        last["content"] = content + suffix
    return [*messages[:-1], last]
