"""Writers of the input formats `prepare-data` reads, as their own tools write them, for the tests.

Each writes documents (text) or token ids (pre-tokenised) the way users' files hold them: Arrow IPC streams
as `datasets.Dataset.save_to_disk` leaves them (with its `state.json`), Parquet, ArrayRecord (Grain's and
MaxText's format) and Megatron-LM's indexed datasets (`.bin` + `.idx`, `MMIDIDX` version 1).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

MEGATRON_DTYPES = {1: "u1", 3: "<i2", 4: "<i4", 5: "<i8", 8: "<u2"}  # the integer codes of the .idx header
MEGATRON_CODES = {np.dtype(dtype): code for code, dtype in MEGATRON_DTYPES.items()}


def _table(column: str, values: Sequence):
    import pyarrow as pa

    if values and not isinstance(values[0], str):
        return pa.table({column: pa.array([list(map(int, v)) for v in values], type=pa.list_(pa.int32()))})
    return pa.table({column: pa.array(list(values), type=pa.string())})


def write_arrow(path: Path, values: Sequence, column: str = "text") -> Path:
    """An Arrow IPC stream file with one column: strings (documents) or int32 lists (token ids)."""
    return write_arrow_table(path, _table(column, values))


def write_arrow_table(path: Path, table, batch_rows: int = 2) -> Path:
    """`table` as an Arrow IPC stream of small record batches, as `Dataset.save_to_disk` writes it."""
    import pyarrow as pa

    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
    return path


def write_saved_dataset(directory: Path, values: Sequence, column: str = "text", files: int = 2) -> Path:
    """A directory as `datasets.Dataset.save_to_disk` writes it: `data-0000K-of-0000N.arrow`, `state.json`,
    `dataset_info.json`."""
    directory.mkdir(parents=True)
    names = [f"data-{k:05d}-of-{files:05d}.arrow" for k in range(files)]
    cuts = np.linspace(0, len(values), files + 1).astype(int)
    for name, start, stop in zip(names, cuts, cuts[1:]):
        write_arrow(directory / name, values[start:stop], column)
    (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                      "_fingerprint": "0", "_split": None}))
    (directory / "dataset_info.json").write_text(json.dumps({"features": {column: {"_type": "Value"}}}))
    return directory


def write_parquet(path: Path, values: Sequence, column: str = "text") -> Path:
    import pyarrow.parquet as pq

    pq.write_table(_table(column, values), str(path), row_group_size=13)
    return path


def write_arrayrecord(path: Path, records: Sequence[bytes]) -> Path:
    """An ArrayRecord file holding `records` (UTF-8 documents, or little-endian int32 ids)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(path), "group_size:2")
    for record in records:
        writer.write(record)
    writer.close()
    return path


def write_megatron(prefix: Path, sequences: Sequence, dtype=np.uint16) -> Path:
    """A Megatron-LM indexed dataset `prefix.bin` + `prefix.idx` (one document per sequence); returns .bin."""
    dtype = np.dtype(dtype)
    arrays = [np.asarray(s, dtype=dtype) for s in sequences]
    sizes = np.array([a.size for a in arrays], dtype="<i4")
    pointers = np.cumsum([0] + [a.nbytes for a in arrays])[:-1].astype("<i8")
    prefix.with_suffix(".bin").write_bytes(b"".join(a.tobytes() for a in arrays))
    header = struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, MEGATRON_CODES[dtype], len(arrays), len(arrays) + 1)
    documents = np.arange(len(arrays) + 1, dtype="<i8")
    prefix.with_suffix(".idx").write_bytes(header + sizes.tobytes() + pointers.tobytes() + documents.tobytes())
    return prefix.with_suffix(".bin")
