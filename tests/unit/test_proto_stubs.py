"""The committed stubs must be exactly what `make proto` generates from generate.proto."""

from pathlib import Path

from pytgi_proto import build


def test_stubs_match_proto() -> None:
    for name, text in build.render().items():
        committed = (build.PROTO_DIR / name).read_text()
        assert committed == text, f"proto/{name} is stale: run `make proto`"


def test_stub_package_imports() -> None:
    from pytgi_proto import generate_pb2, generate_pb2_grpc

    assert generate_pb2.Request(id=7, input_ids=[1, 2]).input_ids == [1, 2]
    assert hasattr(generate_pb2_grpc, "TextGenerationServiceStub")
    assert Path(build.PROTO_DIR / build.PROTO_FILE).exists()
