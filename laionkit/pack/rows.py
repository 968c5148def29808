"""A shard's input rows, read from only the row groups that hold them and made JSON-safe for img2dataset.

Invariant: no sample is lost to a value img2dataset cannot serialise; every value changed is counted
(``invalid_utf8``, ``converted_columns`` in the shard record).
"""

from __future__ import annotations

import base64
import datetime
import decimal
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from laionkit.common.storage import Location
from laionkit.pack.plan import ShardTask


def read_rows(task: ShardTask, storage_options: dict | None = None) -> pa.Table:
    """The shard's rows, reading only the row groups that hold them, renamed for img2dataset."""
    parquet = pq.ParquetFile(Location.parse(task.input, storage_options).open_read())
    groups, first_row, offset = [], None, 0
    for index in range(parquet.metadata.num_row_groups):
        group_rows = parquet.metadata.row_group(index).num_rows
        if offset < task.stop and offset + group_rows > task.start:
            groups.append(index)
            first_row = offset if first_row is None else first_row
        offset += group_rows
    columns = [name for name, _ in task.extra_columns] + [task.caption_column, task.url_column]
    table = parquet.read_row_groups(groups, columns=columns)
    table = table.slice(task.start - first_row, task.stop - task.start)
    table = table.rename_columns([renamed for _, renamed in task.extra_columns] + ["caption", "url"])
    return json_safe_table(table)


def json_safe_table(table: pa.Table) -> tuple[pa.Table, dict[str, dict[str, Any]]]:
    """Make every column something img2dataset can put in a sample's json, and say what was changed.

    img2dataset serialises each sample's json only after counting it a success, and drops the sample
    if that fails: a timestamp column used to empty whole tars while their records claimed success.
    Text with invalid UTF-8 (which parquet writers do not always check) used to fail the whole shard on
    every rerun; it is decoded with U+FFFD replacement and the values are counted. Returns the table
    and ``{"invalid_utf8": {column: values repaired}, "converted_columns": {column: original type}}``.
    """
    repaired, converted = {}, {}
    for index, name in enumerate(table.column_names):
        column = table.column(index)
        kind = column.type
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            try:
                column.validate(full=True)
                continue
            except pa.ArrowInvalid:
                values, bad = _decode_utf8(column.cast(pa.large_binary()).to_pylist())
                repaired[name] = bad
                column = pa.array(values, kind)
        elif name in ("caption", "url") and _is_binary(kind):
            values, bad = _decode_utf8(column.to_pylist())
            repaired.update({name: bad} if bad else {})
            converted[name] = str(kind)
            column = pa.array(values, pa.string())
        elif _json_unsafe(kind):
            converted[name] = str(kind)
            column = pa.array([_json_safe(value) for value in column.to_pylist()])
        else:
            continue
        table = table.set_column(index, name, column)
    return table, {"invalid_utf8": repaired, "converted_columns": converted}


def _decode_utf8(values: list[bytes | None]) -> tuple[list[str | None], int]:
    decoded, bad = [], 0
    for value in values:
        if value is None:
            decoded.append(None)
            continue
        try:
            decoded.append(value.decode("utf-8"))
        except UnicodeDecodeError:
            decoded.append(value.decode("utf-8", errors="replace"))
            bad += 1
    return decoded, bad


def _is_binary(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind)


def _json_unsafe(kind: pa.DataType) -> bool:
    """Types whose Python values json.dumps refuses (times, decimals, bytes), also inside lists/structs."""
    if pa.types.is_temporal(kind) or pa.types.is_decimal(kind) or _is_binary(kind):
        return True
    if pa.types.is_dictionary(kind):
        return _json_unsafe(kind.value_type)
    if pa.types.is_map(kind):
        return _json_unsafe(kind.key_type) or _json_unsafe(kind.item_type)
    if pa.types.is_struct(kind):
        return any(_json_unsafe(kind.field(i).type) for i in range(kind.num_fields))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _json_unsafe(kind.value_type)
    return False


def _json_safe(value: Any) -> Any:
    """ISO 8601 for times, a string for decimals (no float rounding), base64 for bytes, seconds for durations."""
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    if value is not None and not isinstance(value, (str, int, float, bool)):
        return str(value)  # e.g. an interval: readable rather than a lost sample
    return value
