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

# Definitions a function's parameters may refer to (`#/$defs/X`): hoisted to the grammar's root,
# where those references point once the parameters sit under `$functions`.
_DEFINITIONS = ("$defs", "definitions")


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
    return [_tool(t, i) for i, t in enumerate(value)]


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

    def grammar(self) -> dict[str, Any]:
        """TGI's tool grammar: `$functions` (each with a required `_name` const first, then its
        own properties, closed) and `function` as an `anyOf` of references to them. The root is
        a required, closed object too, so `{}` is not an answer."""
        functions: dict[str, Any] = {}
        definitions: dict[str, dict[str, Any]] = {}
        for tool in self.tools:
            functions[tool.name] = _function_schema(tool)
            for key in _DEFINITIONS:
                if isinstance(tool.parameters.get(key), dict):
                    definitions.setdefault(key, {}).update(tool.parameters[key])
        refs = [{"$ref": f"#/$functions/{_pointer(t.name)}"} for t in self.tools]
        schema: dict[str, Any] = {
            "$functions": functions,
            "type": "object",
            "properties": {"function": {"anyOf": refs}},
            "required": ["function"],
            "additionalProperties": False,
            **definitions,
        }
        return {"type": "json", "value": schema}


def _function_schema(tool: Tool) -> dict[str, Any]:
    props = tool.parameters.get("properties")
    required = tool.parameters.get("required")
    properties: dict[str, Any] = {"_name": {"type": "string", "const": tool.name}}
    if isinstance(props, dict):
        properties.update(props)
    out: dict[str, Any] = {"type": "object"}
    if tool.description is not None:
        out["description"] = tool.description
    out["properties"] = properties
    out["required"] = ["_name", *(required if isinstance(required, list) else [])]
    out["additionalProperties"] = False
    return out


def _pointer(name: str) -> str:
    """A JSON-pointer token (RFC 6901) for a function name."""
    return name.replace("~", "~0").replace("/", "~1")


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
    last["content"] = (last.get("content") or "") + suffix
    return [*messages[:-1], last]
