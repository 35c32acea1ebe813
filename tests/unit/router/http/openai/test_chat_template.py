"""Chat templates: rendering like transformers, continue-final-message, sandbox, source order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytgi_router.core.errors import TemplateError, ValidationError
from pytgi_router.http.model_files import ModelFiles
from pytgi_router.http.openai.chat_template import ChatTemplate, load_chat_template
from pytgi_router.http.openai.schemas import parse_chat
from tests.tiny_models import CHAT_TEMPLATE

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello"},
]


def test_renders_like_the_model_template_with_generation_prompt() -> None:
    t = ChatTemplate(CHAT_TEMPLATE, "<s>", "</s>")
    assert t.apply(MESSAGES) == (
        "<s><|system|>\nBe brief.</s>\n<|user|>\nHello</s>\n<|assistant|>\n"
    )


def test_matches_transformers_apply_chat_template(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ours = load_chat_template(ModelFiles(str(tiny_model_dir)))
    assert ours is not None
    expected = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.apply(MESSAGES) == expected
    cont = [*MESSAGES, {"role": "assistant", "content": "Hi th"}]
    expected_cont = tok.apply_chat_template(cont, tokenize=False, continue_final_message=True)
    assert ours.apply(cont) == expected_cont


def test_a_final_assistant_message_is_continued() -> None:
    t = ChatTemplate(CHAT_TEMPLATE, "<s>", "</s>")
    out = t.apply([*MESSAGES, {"role": "assistant", "content": "Once upon"}])
    assert out.endswith("<|assistant|>\nOnce upon")


def test_raise_exception_and_runtime_errors_are_template_errors() -> None:
    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}"
                     "{{ raise_exception('first message must be from the user') }}{% endif %}")
    with pytest.raises(TemplateError) as info:
        t.apply(MESSAGES)
    assert info.value.status_code == 422 and info.value.error_type == "template_error"
    assert "first message must be from the user" in info.value.message
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").apply(MESSAGES)


def test_sandbox_blocks_python_internals() -> None:
    t = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TemplateError):
        t.apply(MESSAGES)


def test_syntax_errors_surface_at_request_time() -> None:
    t = ChatTemplate("{% for m in messages %}")
    with pytest.raises(TemplateError):
        t.apply(MESSAGES)


def test_helpers_tojson_strftime_and_generation_tag() -> None:
    t = ChatTemplate(
        "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|"
        "{% generation %}{{ messages[1].content }}{% endgeneration %}"
    )
    msgs = [{"role": "user", "content": "<b>&é"}, {"role": "assistant", "content": "x"}]
    rendered = t.apply([*msgs, {"role": "user", "content": "y"}])
    head, year, gen = rendered.split("|")
    assert json.loads(head)[0]["content"] == "<b>&é"  # not HTML-escaped
    assert year == "4" and gen == "x"


def _write(d: Path, name: str, data: object) -> None:
    (d / name).write_text(json.dumps(data) if not isinstance(data, str) else data)


def test_source_order(tmp_path: Path) -> None:
    cfg = {"bos_token": {"content": "<B>"}, "eos_token": "<E>", "chat_template": "cfg:{{ bos_token }}"}
    _write(tmp_path, "tokenizer_config.json", cfg)
    files = ModelFiles(str(tmp_path))
    t = load_chat_template(files)
    assert t is not None and t.apply(MESSAGES) == "cfg:<B>"
    # An explicit tokenizer config replaces the model's.
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "alt"}]}))
    t = load_chat_template(files, str(other))
    assert t is not None and t.apply(MESSAGES) == "alt"
    # chat_template.json wins over both, chat_template.jinja over that.
    _write(tmp_path, "chat_template.json", {"chat_template": "json:{{ eos_token }}"})
    t = load_chat_template(files)
    assert t is not None and t.apply(MESSAGES) == "json:<E>"
    _write(tmp_path, "chat_template.jinja", "jinja")
    t = load_chat_template(files)
    assert t is not None and t.apply(MESSAGES) == "jinja"


def test_no_template_anywhere(tmp_path: Path) -> None:
    _write(tmp_path, "tokenizer_config.json", {"bos_token": "<s>"})
    assert load_chat_template(ModelFiles(str(tmp_path))) is None


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Only the tokenizer files of the tiny model (no weights needed here)."""
    from tests.tiny_models import _CORPUS, train_tokenizer, write_tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, train_tokenizer(_CORPUS), 256)
    return d


def test_chat_template_kwargs_reach_the_template_but_cannot_replace_its_variables() -> None:
    """vLLM's `chat_template_kwargs` (Qwen3's `enable_thinking: false` renders an empty
    thinking block)."""
    t = ChatTemplate("{{ messages[-1].content }}{% if enable_thinking is false %}<think>\n\n"
                     "</think>{% endif %}{{ add_generation_prompt }}")
    user = [{"role": "user", "content": "hi"}]
    assert t.apply(user) == "hiTrue"
    assert t.apply(user, kwargs={"enable_thinking": False}) == "hi<think>\n\n</think>True"
    assert t.apply(user, kwargs={"messages": [], "add_generation_prompt": False}) == "hiTrue"
    chat = parse_chat({"messages": user, "chat_template_kwargs": {"enable_thinking": False}})
    assert chat.template_kwargs == {"enable_thinking": False}
    with pytest.raises(ValidationError):
        parse_chat({"messages": user, "chat_template_kwargs": ["enable_thinking"]})


def test_an_earlier_turns_reasoning_reaches_the_template() -> None:
    t = ChatTemplate("{% for m in messages %}{{ m.reasoning_content or '' }}|{{ m.content }};"
                     "{% endfor %}")
    chat = parse_chat({"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "thought"},
        {"role": "user", "content": "q2"}]})
    assert t.apply(chat.messages) == "|q;thought|a;|q2;"
