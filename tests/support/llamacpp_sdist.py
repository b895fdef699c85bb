"""llama.cpp's own tokenizer test vocabularies and chat templates, from the llama-cpp-python sdist on PyPI.

The source package vendors llama.cpp, including `models/ggml-vocab-*.gguf` (vocabulary-only GGUF
files) with their `.inp` / `.out` test cases and `models/templates/*.jinja` (real chat templates of
HF models). `files()` downloads the sdist once into a cache directory (`$MOERUN_TEST_CACHE`, else
`~/.cache/moerun-tests`), extracts only those files, and returns where they are. Nothing goes into
git. A failed download raises: the tests that need these files must fail, not skip.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
PREFIX = "vendor/llama.cpp/models/"
_WANTED = ("ggml-vocab-", "templates/")  # under PREFIX
_DONE = ".complete"


@dataclass(frozen=True)
class LlamaCppFiles:
    """Where the extracted files lie: `models/` holds ggml-vocab-*, `models/templates/` the templates."""

    models: Path

    @property
    def templates(self) -> Path:
        return self.models / "templates"

    def vocabs(self) -> list[Path]:
        """Every vocabulary GGUF file that has `.inp` / `.out` test cases, sorted by name."""
        return sorted(
            p
            for p in self.models.glob("ggml-vocab-*.gguf")
            if p.with_suffix(".gguf.inp").exists() and p.with_suffix(".gguf.out").exists()
        )

    def template_files(self) -> list[Path]:
        """Every chat template file (*.jinja), sorted by name."""
        return sorted(self.templates.glob("*.jinja"))


def cache_dir() -> Path:
    """`$MOERUN_TEST_CACHE`, else `~/.cache/moerun-tests`."""
    return Path(os.environ.get("MOERUN_TEST_CACHE") or Path.home() / ".cache" / "moerun-tests")


def _sdist_url() -> tuple[str, str]:
    """(url, sha256) of the sdist, from PyPI's simple index (PEP 691 JSON, the API pip itself uses)."""
    req = urllib.request.Request(
        f"https://pypi.org/simple/{PACKAGE}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        index = json.load(r)
    name = f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz"
    for f in index["files"]:
        if f["filename"] == name:
            return f["url"], f["hashes"]["sha256"]
    raise RuntimeError(f"PyPI lists no sdist {name} for {PACKAGE}=={VERSION}")


def _download(dest: Path) -> None:
    """Download the sdist to `dest`, checking PyPI's sha256."""
    url, sha = _sdist_url()
    tmp = dest.with_suffix(".part")
    h = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=120) as r, open(tmp, "wb") as out:
        while chunk := r.read(1 << 20):
            h.update(chunk)
            out.write(chunk)
    if h.hexdigest() != sha:
        tmp.unlink()
        raise RuntimeError(f"{url}: sha256 {h.hexdigest()} != PyPI's {sha}")
    tmp.replace(dest)


def _extract(sdist: Path, target: Path) -> None:
    """Extract only models/ggml-vocab-* and models/templates/* from `sdist` into `target`."""
    with tarfile.open(sdist, "r:gz") as tar:
        for m in tar:
            if not m.isfile():
                continue
            parts = m.name.split("/", 1)  # strip "llama_cpp_python-0.3.36/"
            if len(parts) != 2 or not parts[1].startswith(PREFIX):
                continue
            rel = parts[1][len(PREFIX) :]
            if not rel.startswith(_WANTED) or ".." in rel.split("/"):
                continue
            out = target / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(m)
            assert src is not None
            with src, open(out, "wb") as f:
                shutil.copyfileobj(src, f)


def files() -> LlamaCppFiles:
    """Download (once) and extract llama.cpp's vocab test files and templates; return where they are."""
    root = cache_dir() / f"{PACKAGE}-{VERSION}"
    models = root / "models"
    if (root / _DONE).exists():
        return LlamaCppFiles(models)
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"{PACKAGE}-{VERSION}.tar.gz"
    if not sdist.exists():
        _download(sdist)
    tmp = Path(tempfile.mkdtemp(dir=root))
    try:
        _extract(sdist, tmp)
        if models.exists():
            shutil.rmtree(models)
        tmp.rename(models)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sdist.unlink()  # keep only what the tests use
    (root / _DONE).touch()
    return LlamaCppFiles(models)


def read_cases(vocab: Path) -> list[tuple[str, list[int]]]:
    """The (text, expected ids) cases of a vocab file, as llama.cpp's tests/test-tokenizer-0 reads them."""
    inp = vocab.with_suffix(".gguf.inp").read_text(encoding="utf-8")
    out = vocab.with_suffix(".gguf.out").read_text(encoding="utf-8")
    texts = inp.split("\n__ggml_vocab_test__\n")
    ids = out.split("\n")
    texts = texts[: len(texts) - 1] if texts and texts[-1] == "" else texts
    return list(zip(texts, [[int(t) for t in line.split()] for line in ids[: len(texts)]], strict=True))


if __name__ == "__main__":
    f = files()
    print(f.models)
    for v in f.vocabs():
        print(v.name, len(read_cases(v)))
    print(len(f.template_files()), "templates")
