"""Where each API puts images, read into the same ImageRefs, each named by its place in the body
the client sent: chat's `image_url` parts, Responses' `input_image`, Anthropic's image blocks
(base64 and url sources); and the markdown images of /generate."""

from __future__ import annotations

from pytgi_router.http.anthropic.request import parse_messages
from pytgi_router.http.media.markdown import has_markdown_image, markdown_images
from pytgi_router.http.openai.chat_template import ChatTemplate
from pytgi_router.http.openai.responses_request import parse_responses
from pytgi_router.http.openai.schemas import parse_chat
from pytgi_router.http.openai.tools import with_tool_prompt


def test_chat_parts() -> None:
    chat = parse_chat({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "image_url", "image_url": {"url": "data:x"}},
                                     {"type": "image_url", "image_url": {"url": "https://h/i"}}]},
        {"role": "user", "content": [{"type": "text", "text": "only text"}]}]})
    assert [(r.where, r.url) for r in chat.images] == [
        ("messages[1].content[1]", "data:x"), ("messages[1].content[2]", "https://h/i")]
    assert chat.messages[2]["content"] == "only text"  # text parts alone stay one string


def test_responses_input_image() -> None:
    body = {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what"},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}
    chat = parse_responses(body, [], "m").chat
    assert [(r.where, r.url) for r in chat.images] == [
        ("input[0].content[1]", "data:image/png;base64,AAAA")]


def test_anthropic_image_blocks() -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://h/a.png"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/webp",
                                     "data": "UklG"}},
        {"type": "text", "text": "compare"}]}]}
    chat = parse_messages(body).chat
    assert [(r.where, r.url) for r in chat.images] == [
        ("messages[0].content[0]", "https://h/a.png"),
        ("messages[0].content[1]", "data:image/webp;base64,UklG")]


def test_generate_markdown_images() -> None:
    found = markdown_images("a ![](data:image/png;base64,AA) b ![]( https://h/x.png ) c")
    assert found.texts == ["a ", " b ", " c"]
    assert [(r.where, r.url) for r in found.images] == [
        ("inputs image 0", "data:image/png;base64,AA"), ("inputs image 1", "https://h/x.png")]
    assert has_markdown_image("![](x)") and not has_markdown_image("![alt](x) ![] (y)")


def test_parts_go_through_tool_prompts_and_continued_turns() -> None:
    parts = [{"type": "text", "text": "see"}, {"type": "image"}]
    out = with_tool_prompt([{"role": "user", "content": parts}], " TOOLS")
    assert out[0]["content"] == [*parts, {"type": "text", "text": " TOOLS"}]
    template = ChatTemplate("{% for m in messages %}{% for p in m['content'] %}"
                            "{{ p['text'] if p['type'] == 'text' else '<img>' }}"
                            "{% endfor %}{% endfor %}")
    assert template.apply([{"role": "assistant", "content": parts}]) == "see<img>"
