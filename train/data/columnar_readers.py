"""Columnar input for `prepare-data`: Parquet files, Arrow IPC files and streams, and the directory a
`datasets.Dataset.save_to_disk` writes.

The documents are one column, `text_field`, of strings (text) or of lists of integers (token ids, as int64
arrays); nulls and empty values are skipped. A file is read one record batch at a time and turned into
Python objects `_BATCH_ROWS` rows at a time. An Arrow file is memory-mapped and each batch fully validated
before use. A `save_to_disk` directory stands for its Arrow files, in the order its `state.json` lists;
a `DatasetDict` directory is refused (one split must be named).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.train.data.source_files import (
    FIX_COLUMN,
    Document,
    check_source_file,
    mapped,
    optional_module,
)
from upcycler.untrusted import describe, escape, load_json_object, open_regular, shown_path

_BATCH_ROWS = 1024  # Parquet/Arrow rows turned into Python objects at a time


def _column_index(pa: ModuleType, schema: Any, text_field: str, path: Path) -> tuple[int, str]:
    """(index, kind) of the column `text_field`: kind `text` for strings, `ids` for lists of integers."""
    names = schema.names
    if text_field not in names:
        raise UpcyclerError(
            f"{shown_path(path)}: no column {text_field!r} (columns: "
            f"{escape(', '.join(names))[:200]}); {FIX_COLUMN}"
        )
    index = schema.get_field_index(text_field)
    if index < 0:
        raise UpcyclerError(f"{shown_path(path)}: more than one column {text_field!r}; fix the file")
    kind = schema.field(index).type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if pa.types.is_null(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind) or (
        getattr(pa.types, "is_string_view", lambda _: False)(kind)
    ):
        return index, "text"
    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    if any(is_list(kind) for is_list in lists) and pa.types.is_integer(kind.value_type):
        return index, "ids"
    raise UpcyclerError(
        f"{shown_path(path)}: column {text_field!r} is {escape(str(kind))[:80]}, neither text nor a list "
        f"of integer token ids; {FIX_COLUMN}"
    )


def _column_documents(pa: ModuleType, column: Any, kind: str, path: Path) -> Iterator[Document]:
    """The documents of one record batch's column, `_BATCH_ROWS` rows at a time (nulls and empties
    skipped)."""
    for start in range(0, len(column), _BATCH_ROWS):
        rows = column.slice(start, _BATCH_ROWS)
        if kind == "text":
            yield from (value for value in rows.to_pylist() if value)
        else:
            yield from _id_lists(pa, rows, path)


def _id_lists(pa: ModuleType, rows: Any, path: Path) -> Iterator[np.ndarray]:
    """Each non-empty list of a list-of-integers column as an int64 array."""
    compute = importlib.import_module("pyarrow.compute")
    lengths = compute.list_value_length(rows).fill_null(0).to_numpy(zero_copy_only=False)
    values = rows.flatten()
    if values.null_count:
        raise UpcyclerError(f"{shown_path(path)}: a null among the token ids; fix the file")
    try:
        ids = np.array(values.cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64)
    except pa.ArrowInvalid:
        raise UpcyclerError(f"{shown_path(path)}: a token id beyond the int64 range; fix the file") from None
    end = 0
    for length in lengths.tolist():
        end += length
        if length:
            yield ids[end - length : end]


def parquet_documents(path: Path, text_field: str) -> Iterator[Document]:
    """The documents of a Parquet file, one record batch at a time."""
    pa = optional_module("pyarrow", path, "Parquet", "pyarrow")
    pq = optional_module("pyarrow.parquet", path, "Parquet", "pyarrow")
    with os.fdopen(open_regular(path, "source file"), "rb") as raw:
        try:
            parquet = pq.ParquetFile(raw)
            _, kind = _column_index(pa, parquet.schema_arrow, text_field, path)
            for batch in parquet.iter_batches(batch_size=_BATCH_ROWS, columns=[text_field]):
                yield from _column_documents(pa, batch.column(0), kind, path)
        except (pa.ArrowException, OSError, ValueError, MemoryError) as err:
            raise UpcyclerError(
                f"{shown_path(path)}: not a readable Parquet file ({escape(str(err))[:120]}); "
                "check the --source path"
            ) from None


def _ipc_batches(pa: ModuleType, source: Any) -> tuple[Any, Iterator[Any]]:
    """(schema, record batches) of an Arrow IPC stream (what `save_to_disk` writes) or IPC file."""
    is_file = source.read(6) == b"ARROW1"
    source.seek(0)
    if is_file:
        reader = pa.ipc.open_file(source)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    reader = pa.ipc.open_stream(source)
    return reader.schema, iter(reader)


def arrow_documents(path: Path, text_field: str) -> Iterator[Document]:
    """The documents of an Arrow IPC file, one record batch at a time (each fully validated first). The file
    is memory-mapped, so a message cannot claim more bytes than the file holds."""
    pa = optional_module("pyarrow", path, "Arrow", "pyarrow")
    source = pa.BufferReader(pa.py_buffer(mapped(path)))
    try:
        schema, batches = _ipc_batches(pa, source)
        index, kind = _column_index(pa, schema, text_field, path)
        for batch in batches:
            batch.validate(full=True)
            yield from _column_documents(pa, batch.column(index), kind, path)
    except (pa.ArrowException, OSError, ValueError, MemoryError) as err:
        raise UpcyclerError(
            f"{shown_path(path)}: not a readable Arrow file ({escape(str(err))[:120]}); "
            "check the --source path"
        ) from None


def saved_dataset_files(directory: Path) -> list[Path] | None:
    """The Arrow files of a directory written by `Dataset.save_to_disk`, in its order (from `state.json`);
    None for another directory. A `DatasetDict` directory is refused: one split must be named."""
    if (directory / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in directory.iterdir() if (p / "state.json").is_file())
        example = ", ".join(shown_path(directory / s) for s in (splits or ["train"])[:4])
        raise UpcyclerError(
            f"{shown_path(directory)}: a DatasetDict (several splits); pass one split directory, "
            f"e.g. {example}"
        )
    state_path = directory / "state.json"
    if not (state_path.is_file() and (directory / "dataset_info.json").is_file()):
        return None
    fix = "re-save the dataset with Dataset.save_to_disk"
    entries = load_json_object(state_path, fix=fix, what="datasets state.json").get("_data_files")
    if not isinstance(entries, list):
        raise UpcyclerError(f"{shown_path(state_path)}: no list `_data_files`; {fix}")
    files = []
    for entry in entries:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name:
            raise UpcyclerError(f"{shown_path(state_path)}: a `_data_files` entry without a filename; {fix}")
        file = directory / name
        if Path(name).is_absolute() or ".." in Path(name).parts or not _inside(file, directory):
            raise UpcyclerError(
                f"{shown_path(state_path)}: data file {describe(name)} lies outside {shown_path(directory)}; "
                f"{fix}"
            )
        check_source_file(file)
        files.append(file)
    return files


def _inside(path: Path, directory: Path) -> bool:
    """Whether `path`, links resolved, lies inside `directory`."""
    return path.resolve().is_relative_to(directory.resolve())
