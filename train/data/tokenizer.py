"""The checkpoint's tokenizer as `prepare-data` uses it: loaded from tokenizer.json, hashed, with its EOS id.

The EOS id is appended after every document. It comes from `--eos` (a token or an id) if given, else from
the Hugging Face config files next to tokenizer.json (`tokenizer_config.json` `eos_token`, then
`generation_config.json` / `config.json` `eos_token_id`), else from well-known special tokens.
Every file is read through `upcycler.untrusted` (regular files only, size-capped, bounded JSON); the
sha256 recorded is that of exactly the bytes the tokenizer was built from.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from upcycler.errors import UpcyclerError
from upcycler.untrusted import describe, escape, load_json_object, read_bytes, shown_path

_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|end|>")
MAX_TOKENIZER_BYTES = 512 * 1024**2  # the largest tokenizer.json files are tens of MB
MAX_VOCAB = 1 << 32  # token files store ids as uint32 at most


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
    if not file.exists():
        raise UpcyclerError(
            f"{shown_path(file)}: no such tokenizer file; pass --tokenizer a tokenizer.json or a model "
            "directory"
        )
    data = read_bytes(file, max_bytes=MAX_TOKENIZER_BYTES, what="tokenizer.json")
    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for malformed files
        raise UpcyclerError(
            f"{shown_path(file)}: not a readable tokenizer.json ({escape(str(err))[:120]}); "
            "re-save it with tokenizers"
        ) from None
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if not 0 < vocab_size <= MAX_VOCAB:
        raise UpcyclerError(
            f"{shown_path(file)}: vocabulary of {vocab_size} tokens; expected 1 to {MAX_VOCAB:,}"
        )
    eos_id = _resolve_eos(tokenizer, file, vocab_size, eos)
    return TokenizerInfo(file, tokenizer, hashlib.sha256(data).hexdigest(), vocab_size, eos_id)


def _resolve_eos(tokenizer: Tokenizer, file: Path, vocab_size: int, eos: str | None) -> int:
    if eos is not None:
        is_id = eos.isascii() and eos.isdigit() and len(eos) <= 12
        eos_id = int(eos) if is_id else tokenizer.token_to_id(eos)
        if eos_id is None or not 0 <= eos_id < vocab_size:
            raise UpcyclerError(
                f"{shown_path(file)}: --eos {describe(eos)} is not a token of this tokenizer; "
                "pass a token or id it has"
            )
        return eos_id
    for found in (_eos_from_configs(tokenizer, file.parent), _eos_from_specials(tokenizer)):
        if found is not None and 0 <= found < vocab_size:
            return found
    raise UpcyclerError(f"{shown_path(file)}: cannot tell which token is EOS; pass --eos TOKEN_OR_ID")


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
    """The JSON object in `path`, `{}` if there is no such file; a file that is there must be valid."""
    if not path.exists():
        return {}
    return load_json_object(path, fix="fix it, or pass --eos TOKEN_OR_ID", what="tokenizer config")

