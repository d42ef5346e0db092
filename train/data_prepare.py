"""Tokenise text sources once into memory-mappable token arrays (the engine of `upcycle prepare-data`).

A prepared directory holds, per named source:
- `NAME.tokens.npy`: a 1-D uint16 array (uint32 when the vocabulary has more than 65536 entries) with
  every document's tokens followed by one EOS id, documents in file order, files in sorted order;
- `NAME.meta.json`: token and document counts, vocab size, EOS id, the tokenizer's sha256 and every
  input file with its size and sha256.
Documents are tokenised in small batches and appended to a temporary file, so memory stays bounded by
one batch whatever the corpus size. The token file is renamed into place when complete and the metadata
is written last, so a source is complete exactly when its metadata exists.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from upcycler.errors import UpcyclerError
from upcycler.train.data_readers import detect_format, read_documents

FORMAT_VERSION = 1
TOKENS_SUFFIX = ".tokens.npy"
META_SUFFIX = ".meta.json"
NPY_HEADER_BYTES = 128
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|end|>")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_BATCH_DOCS = 256
_BATCH_CHARS = 4 << 20


@dataclass(frozen=True)
class TokenizerInfo:
    """A loaded tokenizer with what prepared data records about it."""

    path: Path
    tokenizer: Tokenizer
    sha256: str
    vocab_size: int
    eos_id: int


def load_tokenizer(path: Path, eos: str | None = None) -> TokenizerInfo:
    """Load `tokenizer.json` (or a model directory holding one) and settle the EOS id.

    `eos` is a token string or a decimal id; without it the EOS comes from `tokenizer_config.json`,
    then `generation_config.json` / `config.json`, then well-known special tokens.
    """
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise UpcyclerError(f"{file}: no such tokenizer file; pass --tokenizer a tokenizer.json or a model directory")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception for malformed files
        raise UpcyclerError(f"{file}: not a readable tokenizer.json ({err}); re-save it with tokenizers") from None
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_id = _resolve_eos(tokenizer, file, vocab_size, eos)
    return TokenizerInfo(file, tokenizer, _sha256(file), vocab_size, eos_id)


def _resolve_eos(tokenizer: Tokenizer, file: Path, vocab_size: int, eos: str | None) -> int:
    if eos is not None:
        eos_id = int(eos) if eos.isdigit() else tokenizer.token_to_id(eos)
        if eos_id is None or not 0 <= eos_id < vocab_size:
            raise UpcyclerError(f"{file}: --eos {eos!r} is not a token of this tokenizer; pass a token or id it has")
        return eos_id
    for found in (_eos_from_configs(tokenizer, file.parent), _eos_from_specials(tokenizer)):
        if found is not None and 0 <= found < vocab_size:
            return found
    raise UpcyclerError(f"{file}: cannot tell which token is EOS; pass --eos TOKEN_OR_ID")


def _eos_from_configs(tokenizer: Tokenizer, directory: Path) -> int | None:
    """EOS from the Hugging Face config files next to the tokenizer, if any names one."""
    tokenizer_config = _read_json(directory / "tokenizer_config.json")
    token = tokenizer_config.get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
        return tokenizer.token_to_id(token)
    for name in ("generation_config.json", "config.json"):
        eos_id = _read_json(directory / name).get("eos_token_id")
        if isinstance(eos_id, list) and eos_id:
            eos_id = eos_id[0]
        if isinstance(eos_id, int) and not isinstance(eos_id, bool):
            return eos_id
    return None


def _eos_from_specials(tokenizer: Tokenizer) -> int | None:
    specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    for token in _EOS_CANDIDATES:
        if token in specials:
            return specials[token]
    return None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a `vocab_size` vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def parse_sources(specs: Iterable[str]) -> dict[str, list[Path]]:
    """Parse `NAME=GLOB_OR_FILE` specs into sorted file lists; a repeated NAME adds more files to it."""
    sources: dict[str, list[Path]] = {}
    for spec in specs:
        name, sep, pattern = spec.partition("=")
        if not sep or not _NAME.fullmatch(name) or not pattern:
            raise UpcyclerError(f"--source {spec!r}: expected NAME=GLOB_OR_FILE with NAME like web or code_v2")
        matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise UpcyclerError(f"{pattern}: matches no file; fix the --source {name}=... path or glob")
        sources.setdefault(name, []).extend(f for f in files if f not in sources.get(name, []))
    return sources


def prepare_sources(
    tokenizer: TokenizerInfo,
    sources: Mapping[str, Sequence[Path]],
    out_dir: Path,
    *,
    fmt: str | None = None,
    text_field: str = "text",
    text_unit: str = "file",
    overwrite: bool = False,
) -> list[dict]:
    """Tokenise every source into `out_dir`; returns each source's metadata, in order.

    Everything that can be checked before tokenising (formats, existing outputs) is checked first, so
    a bad argument fails in seconds, not after an hour of tokenising.
    """
    formats = {name: [(f, fmt or detect_format(f)) for f in files] for name, files in sources.items()}
    for name in sources:
        existing = [p for p in (out_dir / f"{name}{TOKENS_SUFFIX}", out_dir / f"{name}{META_SUFFIX}") if p.exists()]
        if existing and not overwrite:
            raise UpcyclerError(f"{existing[0]}: already exists; choose another --out or pass --overwrite")
    if out_dir.exists() and not out_dir.is_dir():
        raise UpcyclerError(f"{out_dir}: exists and is not a directory; choose another --out")
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        return [
            _prepare_source(name, files, out_dir, tokenizer, text_field=text_field, text_unit=text_unit)
            for name, files in formats.items()
        ]
    except BaseException:
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise


def _prepare_source(
    name: str, files: Sequence[tuple[Path, str]], out_dir: Path, tok: TokenizerInfo, *, text_field: str, text_unit: str
) -> dict:
    """Tokenise one source's files into `NAME.tokens.npy`, then write `NAME.meta.json`."""
    (out_dir / f"{name}{META_SUFFIX}").unlink(missing_ok=True)
    dtype = token_dtype(tok.vocab_size)
    num_docs = 0
    with _TokenFile(out_dir / f"{name}{TOKENS_SUFFIX}", dtype) as out:
        for path, fmt in files:
            docs = read_documents(path, fmt, text_field=text_field, text_unit=text_unit)
            for ids, count in _tokenised_batches(tok, docs):
                out.append(ids)
                num_docs += count
        if out.count == 0:
            raise UpcyclerError(f"{files[0][0]}: source {name!r} has no text; check --format and --text-field")
    meta = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "tokens_file": f"{name}{TOKENS_SUFFIX}",
        "dtype": dtype.name,
        "num_tokens": out.count,
        "num_documents": num_docs,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "tokenizer": {"file": str(tok.path), "sha256": tok.sha256},
        "input": _input_settings({fmt for _, fmt in files}, text_field, text_unit),
        "files": [{"path": str(p), "bytes": p.stat().st_size, "sha256": _sha256(p)} for p, _ in files],
    }
    _write_json_atomic(out_dir / f"{name}{META_SUFFIX}", meta)
    return meta


def _input_settings(formats: set[str], text_field: str, text_unit: str) -> dict:
    """The reading options that shaped the documents, for the metadata."""
    settings: dict = {"formats": sorted(formats)}
    if formats - {"text"}:
        settings["text_field"] = text_field
    if "text" in formats:
        settings["text_unit"] = text_unit
    return settings


def _tokenised_batches(tok: TokenizerInfo, docs: Iterable[str]) -> Iterator[tuple[np.ndarray, int]]:
    """Token ids of `docs`, each document followed by EOS, in bounded batches: (ids, documents in it)."""
    batch: list[str] = []
    chars = 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield _encode(tok, batch)
            batch, chars = [], 0
    if batch:
        yield _encode(tok, batch)


def _encode(tok: TokenizerInfo, docs: list[str]) -> tuple[np.ndarray, int]:
    encode = getattr(tok.tokenizer, "encode_batch_fast", tok.tokenizer.encode_batch)
    flat: list[int] = []
    count = 0
    for encoding in encode(docs, add_special_tokens=False):
        if encoding.ids:
            flat.extend(encoding.ids)
            flat.append(tok.eos_id)
            count += 1
    return np.asarray(flat, dtype=np.int64), count


def npy_header(dtype: np.dtype, count: int) -> bytes:
    """A version-1.0 `.npy` header for a 1-D array, always `NPY_HEADER_BYTES` long so it can be rewritten."""
    text = repr({"descr": np.dtype(dtype).str, "fortran_order": False, "shape": (count,)}).encode("latin1")
    size = NPY_HEADER_BYTES - 10
    return b"\x93NUMPY\x01\x00" + size.to_bytes(2, "little") + text + b" " * (size - len(text) - 1) + b"\n"


class _TokenFile:
    """A 1-D `.npy` file built by appending, under a temporary name renamed into place only on success."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path = path
        self.dtype = dtype
        self.count = 0
        self._tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")

    def __enter__(self) -> _TokenFile:
        self._file = self._guard(lambda: open(self._tmp, "wb"))
        self._guard(lambda: self._file.write(npy_header(self.dtype, 0)))
        return self

    def append(self, ids: np.ndarray) -> None:
        self._guard(lambda: self._file.write(ids.astype(self.dtype).tobytes()))
        self.count += ids.size

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._guard(self._finish)
                self._file.close()
                os.replace(self._tmp, self.path)
        finally:
            self._file.close()
            self._tmp.unlink(missing_ok=True)

    def _finish(self) -> None:
        self._file.seek(0)
        self._file.write(npy_header(self.dtype, self.count))
        self._file.flush()
        os.fsync(self._file.fileno())

    def _guard(self, action):
        try:
            return action()
        except OSError as err:
            raise UpcyclerError(f"{self._tmp}: cannot write ({err.strerror}); free disk space or choose another --out") from None


def _write_json_atomic(path: Path, value: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        raise UpcyclerError(f"{path}: cannot write ({err.strerror}); free disk space or choose another --out") from None
    finally:
        tmp.unlink(missing_ok=True)
