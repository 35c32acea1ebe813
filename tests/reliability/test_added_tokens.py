"""Issue 11 item 6 over HTTP: a tokenizer whose added token has no row in the model's embedding
(id >= the vocabulary size the shard reports in Info) gets a 422 in TGI's error shape for that
request, while a stream already running goes on to its end."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import httpx
from tokenizers import Tokenizer

from tests.router_process import RouterProcess
from tests.shard_process import ShardProcesses
from tests.tiny_models import VOCAB_SIZE

ADDED = "<|beyond|>"


def tokenizer_with_added_token(model: Path, dest: Path) -> Path:
    shutil.copytree(model, dest)
    tokenizer = Tokenizer.from_file(str(dest / "tokenizer.json"))
    tokenizer.add_special_tokens([ADDED])
    assert tokenizer.token_to_id(ADDED) >= VOCAB_SIZE
    tokenizer.save(str(dest / "tokenizer.json"))
    return dest


def test_an_added_token_beyond_the_vocabulary_is_refused_alone(
    shard: ShardProcesses, llama: Path, tmp_path: Path
) -> None:
    tokenizer_dir = tokenizer_with_added_token(llama, tmp_path / "tok")
    with RouterProcess(shard.urls[0], tokenizer_dir) as router:
        events: list[dict] = []
        started = threading.Event()

        def stream() -> None:
            body = {"inputs": "The quick brown fox",
                    "parameters": {"max_new_tokens": 40, "ignore_eos": True}}
            with httpx.stream("POST", f"{router.url}/generate_stream", json=body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        events.append(json.loads(line[5:]))
                        started.set()

        thread = threading.Thread(target=stream)
        thread.start()
        assert started.wait(30)
        r = httpx.post(f"{router.url}/generate", json={"inputs": f"Hello {ADDED}"}, timeout=30)
        thread.join(60)
        assert r.status_code == 422, r.text
        assert r.json()["error_type"] == "validation"
        assert "outside the model's vocabulary of 384 tokens" in r.json()["error"]
        assert len(events) == 40 and "error" not in events[-1]
        assert events[-1]["details"] is None and events[-1]["generated_text"] is not None
