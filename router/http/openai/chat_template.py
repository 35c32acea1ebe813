"""Chat templates: the model's Jinja template rendered in a sandbox, as transformers and TGI do.

Source order: chat_template.jinja / chat_template.json, then the tokenizer config (the
--tokenizer-config-path file when given, else the model's tokenizer_config.json), then
processor_config.json. A list of named templates uses the one called "default".
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pytgi_router.core.errors import TemplateError
from pytgi_router.http.model_files import ModelFiles, read_json

log = logging.getLogger("pytgi.router")


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' training-mask marker): renders
    its body unchanged, so templates that use it work here too."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes, which would corrupt prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self._compile_error: str | None = None
        self._template: jinja2.Template | None = None
        # Whether the template renders `tools` itself (else TGI appends them to the last message).
        self.uses_tools = False
        try:
            env = _environment()
            self.uses_tools = "tools" in meta.find_undeclared_variables(env.parse(source))
            self._template = env.from_string(source)
        except jinja2.TemplateError as err:
            self._compile_error = str(err)
            log.warning("the chat template does not compile: %s", err)

    def apply(
        self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Renders the conversation; a final assistant message is continued, not closed.
        `kwargs` (the request's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`) are
        more template variables; they cannot replace the ones rendered here."""
        if self._template is None:
            raise TemplateError(self._compile_error or "template not found")
        continue_final = bool(messages) and messages[-1].get("role") == "assistant"
        try:
            variables = {
                **(kwargs or {}),
                "messages": messages,
                "bos_token": self.bos_token,
                "eos_token": self.eos_token,
                "add_generation_prompt": not continue_final,
                "tools": tools,
            }
            rendered = self._template.render(variables)
        except jinja2.TemplateError as err:
            raise TemplateError(str(err)) from None
        except Exception as err:  # a template bug (e.g. a type error) is the user's 422, not a 500
            raise TemplateError(f"{type(err).__name__}: {err}") from None
        if continue_final:
            content = messages[-1].get("content") or ""
            # A content of parts (images) has no one text to cut at: the render stays whole.
            cut = rendered.rfind(content) if content and isinstance(content, str) else -1
            if cut >= 0:
                rendered = rendered[: cut + len(content)]
        return rendered


def _special(value: Any) -> str | None:
    """A special token as tokenizer configs write it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _pick(template: Any) -> str | None:
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


def load_chat_template(
    files: ModelFiles, tokenizer_config_path: str | None = None
) -> ChatTemplate | None:
    config: dict[str, Any] = {}
    if tokenizer_config_path:
        config = read_json(Path(tokenizer_config_path))
    else:
        config = files.read_json("tokenizer_config.json") or {}
    source: str | None = None
    jinja_file = files.find("chat_template.jinja")
    if jinja_file is not None:
        source = jinja_file.read_text(encoding="utf-8")
    if source is None:
        source = _pick((files.read_json("chat_template.json") or {}).get("chat_template"))
    if source is None:
        source = _pick(config.get("chat_template"))
    if source is None:
        source = _pick((files.read_json("processor_config.json") or {}).get("chat_template"))
    if source is None:
        return None
    return ChatTemplate(source, _special(config.get("bos_token")), _special(config.get("eos_token")))
