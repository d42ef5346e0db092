"""The on-disk format of a prepared-data directory, shared by its writer (`prepare`) and reader (`sources`).

Per named source, a prepared directory holds:
- `NAME.tokens.npy` (`TOKENS_SUFFIX`): a 1-D array of `token_dtype(vocab_size)` (uint16, or uint32 when
  the vocabulary has more than 65536 entries) behind a version-1.0 `.npy` header that is always
  `NPY_HEADER_BYTES` long (`npy_header`), so the writer can rewrite it with the final count after
  appending and the reader can compare it byte for byte and memory-map the tokens at a fixed offset;
- `NAME.meta.json` (`META_SUFFIX`), written last: `format_version` (`FORMAT_VERSION`), `name`,
  `tokens_file`, `dtype` (one of `TOKEN_DTYPES`), `num_tokens`, `num_documents`, `vocab_size`, `eos_id`,
  `tokenizer` {`file`, `sha256`}, `input` (the reading options) and `files` [{`path`, `bytes`, `sha256`}].
"""

from __future__ import annotations

import numpy as np

FORMAT_VERSION = 1
TOKENS_SUFFIX = ".tokens.npy"
META_SUFFIX = ".meta.json"
NPY_HEADER_BYTES = 128
TOKEN_DTYPES = ("uint16", "uint32")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a `vocab_size` vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def npy_header(dtype: np.dtype, count: int) -> bytes:
    """A version-1.0 `.npy` header for a 1-D array, always `NPY_HEADER_BYTES` long so it can be rewritten."""
    text = repr({"descr": np.dtype(dtype).str, "fortran_order": False, "shape": (count,)}).encode("latin1")
    size = NPY_HEADER_BYTES - 10
    return b"\x93NUMPY\x01\x00" + size.to_bytes(2, "little") + text + b" " * (size - len(text) - 1) + b"\n"
