"""The native CPU library: ``cpu_attention.cpp``, ``cpu_tile_attention.cpp`` and ``cpu_decoder.cpp``, compiled once
with the system C++ compiler into one shared library and loaded with ctypes (bound by `cpu_ops` and `cpu_decoder`).

The library is built with ``-march=native`` into ``$HF_PAGED_CACHE/kernels-<uid>`` (default
``~/.cache/hf_paged/kernels-<uid>``: one per user, so that users sharing a cache of models each build their own),
keyed by the sources, the flags, the compiler and the CPU, and shares torch's OpenMP runtime. Without a compiler
`library()` is None and the callers keep their torch paths. The directory is created private (0700), and a library or
directory that another user could have written is never loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

from ..default_model import cache_root

_HERE = Path(__file__).parent
_HEADERS = (_HERE / "cpu_kernels.h",)
_COMMON = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++17"]
# Each source with its own flags: attention with -ffast-math; the decoder without it and without FMA contraction, so
# that its elementwise steps round as torch's do.
SOURCES = {
    _HERE / "cpu_attention.cpp": [*_COMMON, "-ffast-math"],
    _HERE / "cpu_tile_attention.cpp": [*_COMMON, "-ffast-math"],
    _HERE / "cpu_decoder.cpp": [*_COMMON, "-ffp-contract=off"],
}
# Linked without -ffast-math: linking with it adds GCC's crtfastmath.o, whose constructor turns on flush-to-zero for
# the whole process when the library loads (every subnormal float anywhere then reads as 0).
LINK_FLAGS = ["-shared", "-fopenmp"]
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failed = False
_bound: set = set()  # the bind functions already applied


def _cpu_id() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def compiler() -> str | None:
    """The C++ compiler the library is built with: ``$CXX``, else ``g++`` or ``c++`` on the PATH."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def kernel_dir() -> Path:
    """This user's ``kernels-<uid>`` directory of the cache root (`cache_root`, which refuses a relative path),
    created private. The library found there is loaded and run, so a directory another user could write to, or
    rename (through a directory above it), is refused."""
    directory = cache_root() / f"kernels-{os.getuid()}"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(directory)
    for parent in directory.parents:
        _check_no_one_else_moves(parent)
    return directory


def _check_no_one_else_moves(directory: Path) -> None:
    """Refuse a directory in which another user could rename or replace entries: one owned by someone else than
    this user or root, or writable by its group or others without the sticky bit (as /tmp has)."""
    info = directory.stat()
    shared = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX
    if info.st_uid not in (0, os.getuid()) or shared:
        raise RuntimeError(f"refusing to load code from under {directory}: another user could replace what it holds "
                           f"(it belongs to uid {info.st_uid}, mode {stat.filemode(info.st_mode)}); set "
                           "HF_PAGED_CACHE to a directory of this user's")


def check_private(path: Path) -> None:
    """Refuse ``path`` unless it is owned by this user and not writable by its group or by others (a symbolic link
    is refused: what it points to could change)."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        raise RuntimeError(f"refusing to load code from {path}: it is a symbolic link")
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(f"refusing to load code from {path}: it must belong to this user (uid {os.getuid()}) and "
                           f"be writable by nobody else (it belongs to uid {info.st_uid}, mode "
                           f"{stat.filemode(info.st_mode)})")


def _compile(compiler_path: str, target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        objects = []
        for source, flags in SOURCES.items():
            obj = Path(tmp) / (source.stem + ".o")
            result = subprocess.run([compiler_path, *flags, "-c", str(source), "-o", str(obj)], capture_output=True,
                                    text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{compiler_path} failed on {source.name}:\n{result.stderr[-2000:]}")
            objects.append(str(obj))
        result = subprocess.run([compiler_path, *LINK_FLAGS, *objects, "-o", str(built)], capture_output=True,
                                text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler_path} failed to link:\n{result.stderr[-2000:]}")
        built.chmod(0o700)
        os.replace(built, target)


def library_path(compiler_path: str) -> Path:
    """Where the library built by this compiler from these sources for this CPU lives."""
    version = subprocess.run([compiler_path, "--version"], capture_output=True, text=True, check=True).stdout
    parts = [path.read_text() for path in (*SOURCES, *_HEADERS)]
    parts += [" ".join(flags) for flags in SOURCES.values()]
    parts += [*LINK_FLAGS, version, platform.machine(), _cpu_id()]
    key = hashlib.sha256("\0".join(parts).encode())
    return kernel_dir() / f"hf_paged_cpu-{key.hexdigest()[:16]}.so"


def build() -> ctypes.CDLL:
    """Compile the library if this CPU and compiler have no copy yet, check its place, and load it."""
    compiler_path = compiler()
    if compiler_path is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    target = library_path(compiler_path)
    if not target.exists():
        _compile(compiler_path, target)
    check_private(target)
    return ctypes.CDLL(str(target))


def bound(bind) -> ctypes.CDLL | None:
    """The library with ``bind(library)`` (a module's function signatures and layout checks) applied, once; None where
    there is no library."""
    loaded = library()
    if loaded is not None and bind not in _bound:
        with _lock:
            if bind not in _bound:
                bind(loaded)
                _bound.add(bind)
    return loaded


def library() -> ctypes.CDLL | None:
    """The loaded library, built on first call; None (after one warning) where it cannot be built or loaded."""
    global _library, _failed
    if _library is None and not _failed:
        with _lock:
            if _library is None and not _failed:
                try:
                    _library = build()
                except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as error:
                    _failed = True
                    warnings.warn(f"hf_paged: native CPU kernels unavailable, using the torch paths ({error})")
    return _library
