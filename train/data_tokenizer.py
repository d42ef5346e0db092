"""The checkpoint's tokenizer as `prepare-data` uses it: loaded from tokenizer.json, hashed, with its EOS id.

The EOS id is appended after every document. It comes from `--eos` (a token or an id) if given, else from
the Hugging Face config files next to tokenizer.json (`tokenizer_config.json` `eos_token`, then
`generation_config.json` / `config.json` `eos_token_id`), else from well-known special tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from upcycler.errors import UpcyclerError

_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|end|>")


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
        raise UpcyclerError(
            f"{file}: no such tokenizer file; pass --tokenizer a tokenizer.json or a model directory"
        )
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for malformed files
        raise UpcyclerError(
            f"{file}: not a readable tokenizer.json ({err}); re-save it with tokenizers"
        ) from None
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_id = _resolve_eos(tokenizer, file, vocab_size, eos)
    return TokenizerInfo(file, tokenizer, sha256_file(file), vocab_size, eos_id)


def _resolve_eos(tokenizer: Tokenizer, file: Path, vocab_size: int, eos: str | None) -> int:
    if eos is not None:
        eos_id = int(eos) if eos.isdigit() else tokenizer.token_to_id(eos)
        if eos_id is None or not 0 <= eos_id < vocab_size:
            raise UpcyclerError(
                f"{file}: --eos {eos!r} is not a token of this tokenizer; pass a token or id it has"
            )
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


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
