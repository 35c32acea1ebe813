"""A request with images reaches a shard whose model has no vision tower (a text model): refused
in one line (InvalidRequest, the router's 4xx), never run as text. A vision-language model's
shard serves them (tests/unit/shard/models/qwen2_vl/)."""

from __future__ import annotations

import pytest

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.batch import Batch
from pytgi_shard.errors import InvalidRequest
from tests.unit.shard.engine.test_batch import CTX, batch_of, request


def test_a_text_model_refuses_images() -> None:
    image = pb.Image(token_offset=1, token_count=2, dtype="float32", shape=[8, 1176],
                     grid=[1, 2, 4], content_hash=b"h" * 16)
    assert CTX.image_layout is None
    with pytest.raises(InvalidRequest, match="request 1: 1 images, and this model has no vision "
                                             "tower: this shard serves text only"):
        Batch.from_pb(batch_of(request(1, [5, 6, 6, 7], images=[image])), CTX)
    assert len(Batch.from_pb(batch_of(request(2, [5, 6, 6, 7])), CTX).requests) == 1
