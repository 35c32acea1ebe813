"""Generates the Python stubs of generate.proto (`make proto`); never edit the stubs by hand.

`python -m pytgi_proto.build` writes them beside the .proto; `render()` returns them as text so
that a test can compare the committed stubs with what the .proto produces today.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = "generate.proto"
STUBS = ("generate_pb2.py", "generate_pb2.pyi", "generate_pb2_grpc.py")


def render() -> dict[str, str]:
    """Runs protoc on generate.proto and returns {stub file name: text}."""
    with tempfile.TemporaryDirectory() as out:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTO_DIR}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--grpc_python_out={out}",
                str(PROTO_DIR / PROTO_FILE),
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed on {PROTO_FILE} (exit {rc})")
        texts = {name: (Path(out) / name).read_text() for name in STUBS}
    # protoc writes an absolute import; the stubs live inside the pytgi_proto package.
    texts["generate_pb2_grpc.py"] = re.sub(
        r"^import generate_pb2 as", "from . import generate_pb2 as",
        texts["generate_pb2_grpc.py"], flags=re.M,
    )
    return texts


def main() -> int:
    for name, text in render().items():
        (PROTO_DIR / name).write_text(text)
        print(f"wrote proto/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
