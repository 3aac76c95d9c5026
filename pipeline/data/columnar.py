"""Parquet and Arrow datasets, read one record batch at a time.

Parquet: read a row group batch at a time with pyarrow. Arrow: an IPC file or
stream, or a ``datasets`` ``save_to_disk`` directory's shards, memory-mapped
and sliced into batches. A column that is null in a row is left out of that
record, so a record reads as its JSON Lines twin would. A batch none of whose
records the caller wants is counted, never converted to Python objects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from pipeline.data.kinds import KINDS, arrow_shards

BATCH_ROWS = 1024  # records per Parquet / Arrow batch: bounded memory whatever the file size
_ARROW_FILE_MAGIC = b"ARROW1"


def columns(path: Path, kind: str) -> list[str] | None:
    """The column names of a Parquet / Arrow dataset (its schema, no rows read); None for a schema that
    cannot be read (`read_columnar` then reports why)."""
    found = schema(path, kind)
    return None if found is None else found.names


def schema(path: Path, kind: str):
    """The `pyarrow.Schema` of a Parquet / Arrow dataset (no rows read); None where it cannot be read."""
    import pyarrow as pa

    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            return pq.read_schema(path)
        first = arrow_shards(path)[0] if path.is_dir() else path
        with pa.memory_map(str(first)) as source:
            return _open_ipc(source).schema
    except (pa.ArrowException, OSError):
        return None


def read_columnar(path: Path, kind: str, problems: list, owns: Callable[[int], bool] | None,
                  skipped: object) -> Iterator[tuple[None, object]]:
    """(None, record) per row; `skipped` in place of a row `owns(index)` refuses. A fault mid-file (a
    corrupt footer, a truncated shard) appends ``(reason, message, None)`` to `problems` and ends the reading."""
    import pyarrow as pa

    read = 0
    try:
        for batch in _batches(path, kind):
            n = batch.num_rows
            if owns is not None and not any(owns(i) for i in range(read, read + n)):
                read += n
                yield from ((None, skipped) for _ in range(n))
                continue
            for row in batch.to_pylist():
                wanted = owns is None or owns(read)
                read += 1
                yield None, ({key: value for key, value in row.items() if value is not None} if wanted else skipped)
    except (pa.ArrowException, OSError) as err:
        where = f" after {read} record(s)" if read else ""
        problems.append((f"invalid_{kind}", f"cannot read the {KINDS[kind]} data{where}: {err}", None))


def _batches(path: Path, kind: str):
    """The record batches of a Parquet file, an Arrow IPC file or stream, or a save_to_disk dir's shards."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        with pq.ParquetFile(path) as f:
            yield from f.iter_batches(batch_size=BATCH_ROWS)
        return
    import pyarrow as pa

    for shard in (arrow_shards(path) if path.is_dir() else [path]):
        with pa.memory_map(str(shard)) as source:
            reader = _open_ipc(source)
            if isinstance(reader, pa.ipc.RecordBatchFileReader):
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                batches = reader
            for batch in batches:
                # A shard's batches can be large (datasets writes 1000s of rows each): slice, not copy.
                for start in range(0, batch.num_rows, BATCH_ROWS):
                    yield batch.slice(start, BATCH_ROWS)


def _open_ipc(source):
    """An Arrow IPC file reader if `source` has the file magic, else a stream reader."""
    import pyarrow as pa

    head = source.read(len(_ARROW_FILE_MAGIC))
    source.seek(0)
    return pa.ipc.open_file(source) if head == _ARROW_FILE_MAGIC else pa.ipc.open_stream(source)
