"""Images through the running router (issue 28, the router's half), on the tiny Llama's shard.

A text model (a tiny Llama whose tokenizer knows Qwen2-VL's vision tokens): chat, Responses and
Messages refuse image parts with a 4xx in their own error
shape naming the image; /generate keeps TGI's markdown as the text it is. The same shard behind
a router that reads a Qwen2-VL checkpoint's files (config, image processor, tokenizer with its
vision tokens): hostile images get their 422 from the router (bomb, truncated file, SVG, too many
images, URL fetching off by default, a loopback URL or a redirect to a private address), a
good one is fetched (only from a loopback the flag lists), decoded, processed and sent over the
wire, where the shard refuses it in one line: it has no vision towers yet."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.router_process import RouterProcess
from tests.shard_process import ShardProcesses, start_shards
from tests.unit.router.http.media.images import SVG, data_uri, encoded, png_bomb
from tests.vision_checkpoints import (
    write_qwen2_vl_router_files,
    write_text_model_knowing_vision_tokens,
)

PNG = encoded("PNG", (60, 40))
IMAGE = data_uri(PNG)
TOWERLESS = "this model has no vision tower"


class Images(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/to-private":
            self.send_response(302)
            self.send_header("Location", "http://10.0.0.1/a.png")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_text_model_knowing_vision_tokens(tmp_path_factory.mktemp("llama_vision_tokens"))


@pytest.fixture(scope="module")
def shards(model: Path) -> Iterator[ShardProcesses]:
    with start_shards(model) as s:
        yield s


@pytest.fixture(scope="module")
def text(shards: ShardProcesses, model: Path) -> Iterator[str]:
    with RouterProcess(shards.urls[0], model, "--max-total-tokens", "256",
                       "--max-input-tokens", "200") as router:
        yield router.url


@pytest.fixture(scope="module")
def vlm_files(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_vl_router_files(tmp_path_factory.mktemp("qwen2_vl_view"), model)


@pytest.fixture(scope="module")
def vlm(shards: ShardProcesses, vlm_files: Path) -> Iterator[str]:
    with RouterProcess(shards.urls[0], vlm_files, "--max-total-tokens", "256",
                       "--max-input-tokens", "200") as router:
        yield router.url


@pytest.fixture(scope="module")
def vlm_loopback(shards: ShardProcesses, vlm_files: Path) -> Iterator[str]:
    with RouterProcess(shards.urls[0], vlm_files, "--max-total-tokens", "256",
                       "--max-input-tokens", "200", "--allowed-media-domains", "127.0.0.1",
                       "--max-images-per-request", "2") as router:
        yield router.url


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def chat_body(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(parts)}], "max_tokens": 3,
            "temperature": 0}


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


REFUSED = "does not accept images (a text-only model)"


def test_a_text_model_refuses_chat_images_in_each_apis_shape(text: str) -> None:
    r = post(text, "/v1/chat/completions", chat_body({"type": "text", "text": "what is "},
                                                     image_part(IMAGE)))
    # Chat completions answers in TGI's error shape, as TGI does.
    assert r.status_code == 422, r.text
    error = r.json()
    assert error["error_type"] == "validation" and REFUSED in error["error"]
    assert "`messages[0].content[1]` is an image" in error["error"]
    r = post(text, "/chat_tokenize", chat_body(image_part("https://example.com/a.png")))
    assert r.status_code == 422 and REFUSED in r.text
    r = post(text, "/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what"},
        {"type": "input_image", "image_url": IMAGE}]}], "max_output_tokens": 3})
    assert r.status_code == 422, r.text
    assert "`input[0].content[1]` is an image" in r.json()["error"]["message"]
    anthropic_body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": IMAGE.split(",", 1)[1]}}]}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = post(text, path, anthropic_body)
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "`messages[0].content[0]` is an image" in body["error"]["message"]


def test_a_text_model_reads_generate_markdown_as_text_as_tgi_does(text: str) -> None:
    inputs = "Hello ![](https://example.com/a.png)"
    r = post(text, "/generate", {"inputs": inputs, "parameters": {
        "max_new_tokens": 2, "decoder_input_details": True}})
    assert r.status_code == 200, r.text
    tokens = httpx.post(f"{text}/tokenize", json={"inputs": inputs}, timeout=30).json()
    assert len(r.json()["details"]["prefill"]) == len(tokens)


def vlm_generate(url: str, inputs: str) -> httpx.Response:
    return post(url, "/generate", {"inputs": inputs, "parameters": {"max_new_tokens": 2}})


@pytest.mark.parametrize(("image", "reason"), [
    (data_uri(png_bomb()), "400000000 pixels, over the limit of 33554432"),
    (data_uri(png_bomb(8000, 8000)), "8000 x 8000 = 64000000 pixels, over the limit"),
    (data_uri(PNG[:len(PNG) // 2]), "truncated or corrupt"),
    (data_uri(SVG, "image/svg+xml"), "'image/svg+xml' is not an image format"),
    (data_uri(SVG, "image/png"), "not a PNG, JPEG, WebP or GIF image"),
    ("https://example.com/a.png", "fetching image URLs is off"),
    ("file:///etc/passwd", "a data: URI or an http(s) URL"),
])
def test_hostile_images_get_their_422(vlm: str, image: str, reason: str) -> None:
    r = vlm_generate(vlm, f"look ![]({image})")
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "validation"
    assert "image `inputs image 0`: " in r.json()["error"] and reason in r.json()["error"]


def test_too_many_images(vlm: str) -> None:
    r = vlm_generate(vlm, " ".join(f"![]({IMAGE})" for _ in range(9)))
    assert r.status_code == 422 and "image `inputs image 8`: a request carries at most 8" in r.text


def test_a_good_image_reaches_the_shard_which_has_no_vision_towers_yet(vlm: str) -> None:
    r = vlm_generate(vlm, f"look ![]({IMAGE})")
    assert r.status_code == 424 and TOWERLESS in r.text, r.text
    r = post(vlm, "/v1/chat/completions", chat_body({"type": "text", "text": "what is "},
                                                    image_part(IMAGE)))
    assert r.status_code == 424 and TOWERLESS in r.text, r.text
    # Text alone is served as before.
    assert vlm_generate(vlm, "look").status_code == 200


def test_urls_only_from_a_listed_loopback(vlm: str, vlm_loopback: str, image_server: str) -> None:
    url = f"{image_server}/a.png"
    r = vlm_generate(vlm, f"![]({url})")
    assert r.status_code == 422 and "fetching image URLs is off" in r.text
    r = vlm_generate(vlm_loopback, f"![]({url})")
    assert r.status_code == 424 and TOWERLESS in r.text, r.text  # fetched, sent, refused
    r = vlm_generate(vlm_loopback, f"![]({image_server}/to-private)")
    assert r.status_code == 422 and "host 10.0.0.1 is not in --allowed-media-domains" in r.text
    r = vlm_generate(vlm_loopback, f"![]({url}) ![]({url}) ![]({url})")
    assert r.status_code == 422 and "at most 2 images" in r.text


def test_counting_routes_count_image_tokens(vlm: str) -> None:
    """/chat_tokenize and Messages' count_tokens count an image as the tokens it takes."""
    def counted(*parts: dict[str, Any]) -> int:
        r = post(vlm, "/chat_tokenize", chat_body(*parts))
        assert r.status_code == 200, r.text
        return len(r.json()["tokenize_response"])

    with_image = counted({"type": "text", "text": "what is "}, image_part(IMAGE))
    without = counted({"type": "text", "text": "what is "})
    # A 60 x 40 image: 6 image tokens (see test_vision_model), between vision start and end.
    assert with_image - without == 6 + 2
    r = post(vlm, "/v1/messages/count_tokens", {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is "}, {
            "type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": IMAGE.split(",", 1)[1]}}]}]})
    assert r.status_code == 200 and r.json()["input_tokens"] == with_image, r.text


def test_model_info_says_whether_the_model_sees_images(text: str, vlm: str) -> None:
    assert httpx.get(f"{text}/model_info", timeout=10).json()["has_image_understanding"] is False
    assert httpx.get(f"{vlm}/model_info", timeout=10).json()["has_image_understanding"] is True
