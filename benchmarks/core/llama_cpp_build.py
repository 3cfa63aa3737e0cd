"""llama.cpp for sections 6 and 9, built the same way on every machine: `make llama-cpp` (or `python -m
benchmarks.core.llama_cpp_build`).

llama-bench and llama-server (and llama-batched-bench for section 9) come from the llama.cpp source that the
llama-cpp-python sdist vendors (0.3.36: llama.cpp commit 0c1e570; downloaded from PyPI, its sha256 pinned), built
with cmake for the CPU it runs on (`-DGGML_NATIVE=ON`: the peer at its best; statically linked, so the programs need
nothing beside them) into `.cache/llama.cpp/bin`, with the CPU flags they were built for. `llm-bench` finds them
there (`default_bin_dir`); a build for another CPU is not used, and `make llama-cpp` rebuilds it. About 8 minutes on
2 cores; needs cmake and a C++ compiler.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import tarfile
import urllib.request
from pathlib import Path

from launcher.paths import REPO_ROOT

VERSION = "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
URL = (
    "https://files.pythonhosted.org/packages/ec/e9/"
    f"e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-{VERSION}.tar.gz"
)
SECTION_PROGRAMS = ("llama-bench", "llama-server")  # what section 6 runs
IN_PROCESS_PROGRAMS = ("llama-bench", "llama-batched-bench")  # what section 9 runs
PROGRAMS = (*SECTION_PROGRAMS, "llama-batched-bench", "llama-quantize")  # what the build makes (section 9's
# batched decode; llama-quantize: `make bench-kquant`'s file)
FLAGS_FILE = "cpu-flags.txt"


def cache_dir() -> Path:
    """`LLAMA_CPP_CACHE`, else `.cache/llama.cpp` in the checkout."""
    return Path(os.environ.get("LLAMA_CPP_CACHE") or REPO_ROOT / ".cache" / "llama.cpp")


def cpu_flags() -> str:
    """The CPU's feature flags (/proc/cpuinfo), which a native build depends on."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def why_unusable(bin_dir: Path, programs: tuple[str, ...] = SECTION_PROGRAMS) -> str:
    """Why a section cannot use `bin_dir` ('' where it can): its `programs` (section 6's by default) must be there
    and, in this build's own folder, built for this CPU."""
    missing = [p for p in programs if not (bin_dir / p).is_file()]
    if missing:
        return f"{', '.join(missing)} not found in {bin_dir} (make llama-cpp builds them)"
    flags = bin_dir / FLAGS_FILE
    if bin_dir.resolve() != (cache_dir() / "bin").resolve():
        return ""  # a folder of the user's own: theirs to keep current
    if not flags.is_file() or flags.read_text().strip() != cpu_flags():
        return f"the llama.cpp in {bin_dir} was built for another CPU (make llama-cpp rebuilds it)"
    return ""


def default_bin_dir() -> str:
    """Section 6's llama.cpp: `LLAMA_CPP_DIR` if set, else this build's folder."""
    return os.environ.get("LLAMA_CPP_DIR") or str(cache_dir() / "bin")


def sdist(cache: Path) -> Path:
    """The llama-cpp-python sdist, downloaded once from its pinned PyPI address and checked against its hash (not
    through `pip download`, which builds an sdist's metadata first: 8 minutes of CPU for this one)."""
    path = cache / "dl" / URL.rsplit("/", 1)[1]
    if not path.is_file() or _sha256(path) != SHA256:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".part")
        with urllib.request.urlopen(URL, timeout=120) as response, open(partial, "wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
        partial.replace(path)
    if _sha256(path) != SHA256:
        raise SystemExit(f"{path}: sha256 {_sha256(path)}, expected {SHA256}")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _extract(archive: Path, dest: Path) -> None:
    """Unpack the sdist, refusing members that would land outside `dest` (the "data" filter of Python >= 3.11.4,
    checked by hand where the interpreter predates it)."""
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
            return
        root = dest.resolve()
        for member in tar.getmembers():
            target = (dest / member.name).resolve()
            if not (member.isfile() or member.isdir()) or not target.is_relative_to(root):
                raise SystemExit(f"{archive}: refusing member {member.name!r} (not a plain file inside the tree)")
        tar.extractall(dest)


def build(jobs: int, force: bool = False) -> Path:
    cache = cache_dir()
    bin_dir = cache / "bin"
    if not force and why_unusable(bin_dir) == "" and all((bin_dir / p).is_file() for p in PROGRAMS):
        print(f"llama.cpp is built for this CPU in {bin_dir}")
        return bin_dir
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"error: {tool} not found (Debian: apt-get install cmake g++)")
    archive = sdist(cache)
    src = cache / "src"
    shutil.rmtree(src, ignore_errors=True)
    _extract(archive, src)
    source = src / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    build_dir = cache / "build"
    shutil.rmtree(build_dir, ignore_errors=True)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(
        ["cmake", "-S", str(source), "-B", str(build_dir), *generator, "-DCMAKE_BUILD_TYPE=Release"]
        + ["-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF"],
        check=True,
    )
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *PROGRAMS], check=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    for program in PROGRAMS:
        shutil.copy2(build_dir / "bin" / program, bin_dir / program)
    (bin_dir / FLAGS_FILE).write_text(cpu_flags() + "\n")
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(build_dir, ignore_errors=True)
    print(f"llama.cpp (llama-cpp-python {VERSION}) built for this CPU in {bin_dir}")
    return bin_dir


def quantized(bin_dir: Path, source: Path, kind: str) -> Path:
    """`source` re-quantized to `kind` (a llama-quantize type: Q4_K_M, Q6_K, ...) by this build's llama-quantize,
    once, beside the build: the K-quant file that benchmark section 6 serves on both sides (`make bench-kquant`)."""
    out = cache_dir() / "models" / f"{source.stem}.{kind}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".part")
        command = [str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(partial), kind]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        partial.replace(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="parallel compile jobs")
    ap.add_argument("--force", action="store_true", help="rebuild even where a build for this CPU is there")
    ap.add_argument(
        "--quantize",
        metavar="KIND",
        default="",
        help="then print the path of the shipped model's GGUF re-quantized to KIND (e.g. Q4_K_M), made once",
    )
    args = ap.parse_args(argv)
    bin_dir = build(args.jobs, args.force)
    if args.quantize:
        from launcher import prepare_model

        print(quantized(bin_dir, prepare_model.gguf_dir() / prepare_model.GGUF_FILE, args.quantize))


if __name__ == "__main__":
    main()
