"""Our C++ kernels (`lowbit.cpp`: low-bit linear layers; `layer_ops.cpp`: decoder-layer ops; `decoder_stack.cpp`:
a short step's decoder layers in one call), built once with torch's C++ extension tooling and cached.

The build has no CPU-specific flags: each kernel family's vector code is compiled once per instruction set, each copy
with its own target pragma (`isa_copies.h`), and every call runs the copy for the running CPU's instruction set
(`best_isa`, from its flags at run time: `isa.h`), so one artefact serves every x86 machine; the cache key is the
source's hash and the torch version. `make kernels` builds it (`python -m backend.model.kernels`); a server that finds
no build makes one at load (about a minute on 2 cores) or, where that fails, runs the pure-torch path and says
why in the load log.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# The kernels' parallel loops run on their own worker pool (thread_pool.cpp), sized by `set_threads`; no
# OpenMP in this build.
CFLAGS = ["-O3", "-std=c++17", "-ffp-contract=off"]
LDFLAGS = ["-pthread"]
SOURCES = [
    Path(__file__).with_name(n)
    for n in (
        "bindings.cpp",
        "lowbit.cpp",
        "lowbit_int8.cpp",
        "layer_ops.cpp",
        "kv_formats.cpp",
        "decoder_stack.cpp",
        "thread_pool.cpp",
    )
]
HEADERS = [
    Path(__file__).with_name(n)
    for n in (
        "isa.h",
        "isa_copies.h",
        "lowbit_tiles.h",
        "lowbit_int8_tiles.h",
        "layer_ops_copy.h",
        "kv_formats_copy.h",
        "ops.h",
        "kv_formats.h",
        "thread_pool.h",
    )
]  # included: part of the build key
# The instruction sets the server chooses among, by number: isa.h's enum (its test-only copies after these left out);
# the built module says its names (`isa_names()`), and a unit test holds this table to them.
ISA_NAMES = {0: "none", 1: "avx2", 2: "avx512"}
_REPO = Path(__file__).resolve().parents[3]
_state: dict[str, object] = {}


def cache_dir() -> Path:
    """`LLM_KERNEL_CACHE`, else `.cache/kernels` in the checkout."""
    return Path(os.environ.get("LLM_KERNEL_CACHE") or _REPO / ".cache" / "kernels")


def build_key() -> str:
    flags = " ".join(CFLAGS + LDFLAGS)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + (torch.__version__ + flags).encode())
    return digest.hexdigest()[:16]


def load():
    """The compiled module, or None when it cannot be built here (the reason is in `load_error()`)."""
    if "module" in _state:
        return _state["module"]
    module, error = None, ""
    if os.environ.get("LLM_DISABLE_KERNELS", "").lower() in ("1", "true", "yes"):
        error = "disabled by LLM_DISABLE_KERNELS"
    else:
        try:
            from torch.utils import cpp_extension

            _put_pinned_ninja_first_on_path()
            key = build_key()
            build_dir = cache_dir() / key
            build_dir.mkdir(parents=True, exist_ok=True)
            with build_lock(build_dir):
                if not (build_dir / f"llm_kernels_{key}.so").exists():
                    log.info("building the kernels in %s (about a minute on 2 cores, once)", build_dir)
                module = cpp_extension.load(
                    name=f"llm_kernels_{key}",
                    sources=[str(p) for p in SOURCES],
                    build_directory=str(build_dir),
                    extra_cflags=list(CFLAGS),
                    extra_ldflags=list(LDFLAGS),  # load() appends to the lists it is given
                    verbose=False,
                )
        except Exception as exc:  # a missing compiler or ninja: the pure-torch path still serves
            error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    _state["module"], _state["error"] = module, error
    if error:
        log.warning("low-bit kernels unavailable (%s); the pure-torch path serves", error)
    return module


@contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Holds `build_dir`'s build to one process at a time, with a lock that dies with its holder.

    torch's loader locks a build by creating a file named `lock` and waits, forever, while that file exists; a
    build killed half way (Ctrl-C during a first `make serve`, an OOM kill) leaves it behind, and every later
    start then hangs in the model's initialize. Our builds all take this flock first, so whoever holds it knows
    that a `lock` file it finds has no live owner, and removes it."""
    with open(build_dir / "build.flock", "a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is building or checking the kernels in %s", build_dir)
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a kernel build that was stopped half way", stale)
            stale.unlink(missing_ok=True)
        yield  # closing the file releases the lock


def _put_pinned_ninja_first_on_path() -> None:
    """torch's loader runs the first `ninja` on PATH; make it the pinned one (requirements.txt) in every process.
    A system ninja 1.11 and the pinned 1.13 hash a build's command lines differently, so each finds the other's
    build stale and rebuilds it in full: with both in use (a venv interpreter resolves to /usr/bin, beside a
    system ninja; the server's stub has the venv first on PATH) every start after a test run rebuilt the kernels
    in the model's initialize, 1.5 to 3 minutes."""
    try:
        import ninja
    except ImportError:
        return  # torch's loader takes a ninja from PATH, or says it found none
    bin_dir = str(ninja.BIN_DIR)
    rest = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != bin_dir]
    os.environ["PATH"] = os.pathsep.join([bin_dir, *rest])


def load_error() -> str:
    load()
    return str(_state.get("error", ""))


def int8_products(isa: int) -> str:
    """What multiplies `quantization: gguf_int8`'s integers on instruction set `isa` (lowbit_int8.cpp)."""
    module = load()
    return "AVX-512 VNNI" if module is not None and module.int8_vnni(isa) else "AVX2 maddubs"


def best_isa() -> int:
    """2: AVX-512, 1: AVX2 + FMA + F16C, 0: no kernel for this CPU (or no build). `LLM_KERNEL_ISA` (avx2,
    none) lowers it, to exercise the slower paths on a fast CPU."""
    module = load()
    isa = int(module.best_isa()) if module is not None else 0
    forced = os.environ.get("LLM_KERNEL_ISA", "").lower()
    if forced:
        wanted = {name: code for code, name in ISA_NAMES.items()}.get(forced)
        if wanted is None:
            raise ValueError(f"LLM_KERNEL_ISA must be one of {sorted(ISA_NAMES.values())}, got {forced!r}")
        isa = min(isa, wanted)
    return isa


def set_threads(threads: int) -> None:
    """The threads of our kernels' pool; 0 follows torch's intra-op thread count."""
    module = load()
    if module is not None:
        module.set_threads(threads)


def threads() -> int:
    """The threads our kernels compute on, measured (0: no kernels)."""
    module = load()
    return int(module.parallel_threads(64)) if module is not None else 0


def main() -> None:
    """`python -m backend.model.kernels`: build (or find) the kernels and say what this CPU runs."""
    logging.basicConfig(level=logging.INFO)
    built = load()
    state = "built" if built else "NOT built: " + load_error()
    print(
        f"low-bit kernels: {state} in {cache_dir() / build_key()}; this CPU runs {ISA_NAMES[best_isa()]} on "
        f"{threads()} threads"
    )
