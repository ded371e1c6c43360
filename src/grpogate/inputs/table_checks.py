"""A table file's rows, longest cell and nesting checked before Hugging Face datasets reads it.

`datasets` builds a table with pyarrow or pandas and reports a bad file in its own words ("An
error occurred while generating the dataset"), with no line, row or field; a JSONL line
nested 100,000 deep crashes pyarrow's JSON reader (a segmentation fault), and a 13 MB parquet
of 10 million rows takes minutes and gigabytes to build. So every data file is read here
first, in bounded memory, and refused in one line naming the file, the line (text formats) or
row (parquet, Arrow) and the field, and for a bound the config key that raises it:

- JSONL / JSON lines: each line at most 4 bytes a character of `max_cell_chars`, UTF-8,
  nested no deeper than `max_nesting_depth` and with no string longer than `max_cell_chars`
  (files/json_text.scan, before json.loads), then parsed: one JSON object a line. A .json
  file whose text starts with `[` is one document, a list of row objects, checked the same way.
- CSV: each line UTF-8, parsed by the csv module with the cell limit as its field limit.
- parquet: the row count from the footer before any page is decoded, the schema's nesting,
  then one row group at a time (its decoded size from the footer within `max_bytes`).
- Arrow (IPC stream or file): one record batch at a time, each validated in full (offsets
  within their buffers) before any value is read.

Row counts add up over a table's files and stop at `max_rows` + 1, so a file of ten million
rows costs the time of reading one row group or `max_rows` lines, not of building the table.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from grpogate.errors import InputError
from grpogate.files.json_text import compact_text, scan

# A line of a text table holds one row; a character is at most 4 bytes of UTF-8.
BYTES_PER_CHAR = 4
ROW_SLACK_BYTES = 1 << 16  # the row's keys, quotes and other short cells beside its longest


@dataclass(frozen=True)
class TableLimits:
    """The bounds a table is held to: the config's task.max_table_bytes, task.max_table_rows,
    task.max_cell_chars and task.max_nesting_depth (their defaults are the config's)."""

    max_bytes: int
    max_rows: int
    max_cell_chars: int
    max_depth: int

    @classmethod
    def of(cls, task=None) -> TableLimits:
        """The limits of a `config.TaskConfig`; the default config's when None."""
        if task is None:
            from grpogate.config.schema import TaskConfig

            task = TaskConfig()
        return cls(task.max_table_bytes, task.max_table_rows, task.max_cell_chars,
                   task.max_nesting_depth)

    @property
    def max_line_bytes(self) -> int:
        return BYTES_PER_CHAR * self.max_cell_chars + ROW_SLACK_BYTES


KEYS = {"max_bytes": "task.max_table_bytes", "max_rows": "task.max_table_rows",
        "max_cell_chars": "task.max_cell_chars", "max_depth": "task.max_nesting_depth"}


def over_limit(where: str, what: str, limits: TableLimits, name: str) -> InputError:
    """The one-line refusal of a bound: which limit, its value, and how to raise it."""
    key = KEYS[name]
    return InputError(f"{where}: {what}, over the limit {key} = {getattr(limits, name)}; "
                      f"a larger table is read with --set {key}=N")


class RowCounter:
    """Rows of a table's files so far; refused past `limits.max_rows`."""

    def __init__(self, limits: TableLimits, shown: str) -> None:
        self.limits, self.shown, self.rows = limits, shown, 0

    def add(self, count: int, where: str) -> None:
        self.rows += count
        if self.rows > self.limits.max_rows:
            raise over_limit(where, f"more than {self.limits.max_rows} rows", self.limits,
                             "max_rows")


def _text_lines(stream, shown: str, limits: TableLimits, size: int | None = None):
    """(1-based line number, decoded line) of a UTF-8 text read from a binary `stream` (at
    most `size` bytes of it when given), each line bounded before it is decoded. A line of
    UTF-8 never splits a character, so lines decode one by one."""
    number, left = 0, size if size is not None else -1
    while left != 0 and (line := stream.readline(limits.max_line_bytes + 1 if left < 0
                                                 else min(limits.max_line_bytes + 1, left))):
        number += 1
        left = left - len(line) if left > 0 else left
        if len(line) > limits.max_line_bytes:
            raise over_limit(f"{shown}:{number}", f"a line longer than "
                             f"{limits.max_line_bytes} bytes (4 bytes a character of the "
                             "longest cell)", limits, "max_cell_chars")
        try:
            yield number, line.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as error:
            raise InputError(f"{shown}:{number}: not UTF-8 text (byte "
                             f"0x{line[error.start]:02x} at column {error.start + 1}); "
                             "save the file as UTF-8") from None


def json_value(text: str, where: str, limits: TableLimits):
    """One JSON text parsed after its nesting and strings are bounded (files/json_text)."""
    bounds = scan(text, limits.max_depth, limits.max_cell_chars)
    if bounds.too_deep:
        raise over_limit(where, f"nested deeper than {limits.max_depth}", limits, "max_depth")
    if bounds.long_string is not None:
        length, _, key = bounds.long_string
        field = f'field "{key}": ' if key else ""
        raise over_limit(f"{where}: {field}".rstrip(": "), f"a string of {length} characters",
                         limits, "max_cell_chars")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError, RecursionError) as error:
        reason = error.msg if isinstance(error, json.JSONDecodeError) else str(error)
        column = ""
        if isinstance(error, json.JSONDecodeError):
            column = f"{'' if reason.endswith(' at') else ','} column {error.colno}"
        raise InputError(f"{where}: not valid JSON ({reason}{column}); the line may be cut "
                         "off") from None


def check_json_lines(stream, shown: str, limits: TableLimits, counter: RowCounter,
                     size: int | None = None):
    """Every row of a JSON-lines file read from a binary `stream` (at most `size` bytes) as
    (where, object), each line checked (module docstring); blank lines are skipped, as
    datasets skips them."""
    for number, line in _text_lines(stream, shown, limits, size):
        if not line.strip():
            continue
        where = f"{shown}:{number}"
        row = json_value(line, where, limits)
        if not isinstance(row, dict):
            raise InputError(f"{where}: not a JSON object (a row is one object a line)")
        counter.add(1, where)
        yield where, row


def _json_document(path: Path, shown: str, limits: TableLimits, counter: RowCounter) -> None:
    """A .json file holding one document: a list of row objects."""
    # Within max_bytes: checked on its descriptor when staged. A byte-order mark is dropped.
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")
    try:  # the narrowest text json.loads reads (files/json_text.compact_text)
        text = compact_text(data)
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise InputError(f"{shown}:{line}: not UTF-8 text (byte 0x{data[error.start]:02x}); "
                         "save the file as UTF-8") from None
    del data
    rows = json_value(text, shown, limits)
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise InputError(f"{shown}: a JSON document that is not a list of row objects; give "
                         "one object a line (JSONL) or a list of objects")
    counter.add(len(rows), shown)


def check_json(path: Path, shown: str, limits: TableLimits, counter: RowCounter) -> None:
    """A .json or .jsonl file: JSON lines, or (a .json file starting with `[`) one list."""
    with open(path, "rb") as stream:
        head = stream.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if shown.lower().endswith(".json") and head.startswith(b"["):
        _json_document(path, shown, limits, counter)
        return
    with open(path, "rb") as stream:
        for _ in check_json_lines(stream, shown, limits, counter):
            pass


def check_csv(path: Path, shown: str, limits: TableLimits, counter: RowCounter) -> None:
    """A CSV file: UTF-8 lines, every cell within the cell limit, rows counted (the header
    line is not a row, nor is a blank line)."""
    stream = open(path, "rb")
    lines = _text_lines(stream, shown, limits)
    previous = csv.field_size_limit(limits.max_cell_chars)
    try:
        reader = csv.reader((line for _, line in lines), strict=False)
        header = None
        try:
            for record in reader:
                if not record:
                    continue
                if header is None:
                    header = record
                    continue
                counter.add(1, f"{shown}:{reader.line_num}")
        except csv.Error as error:
            where = f"{shown}:{reader.line_num}"
            if "field limit" in str(error):
                raise over_limit(where, f"a cell longer than {limits.max_cell_chars} "
                                 "characters", limits, "max_cell_chars") from None
            raise InputError(f"{where}: not CSV ({error})") from None
    finally:
        csv.field_size_limit(previous)
        stream.close()


# --- parquet and Arrow: pyarrow reads them, one row group or record batch at a time ------------

def _type_depth(arrow_type) -> int:
    """How deep a column's type nests lists, structs and maps (a plain value: 0)."""
    import pyarrow as pa

    if pa.types.is_struct(arrow_type):
        return 1 + max((_type_depth(arrow_type.field(i).type)
                        for i in range(arrow_type.num_fields)), default=0)
    if pa.types.is_map(arrow_type):
        return 1 + max(_type_depth(arrow_type.key_type), _type_depth(arrow_type.item_type))
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or \
            pa.types.is_fixed_size_list(arrow_type) or pa.types.is_list_view(arrow_type):
        return 1 + _type_depth(arrow_type.value_type)
    return 0


def _check_schema(schema, shown: str, limits: TableLimits) -> None:
    for field in schema:
        if _type_depth(field.type) > limits.max_depth:
            raise over_limit(f'{shown}: field "{field.name}"', f"nested deeper than "
                             f"{limits.max_depth}", limits, "max_depth")


def _longest(array) -> tuple[int, int | None]:
    """(the longest text or bytes value under `array`, its row when `array` holds it
    directly, else None)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = array.type
    if pa.types.is_dictionary(kind):
        return _longest(array.dictionary)[0], None
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or \
            pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        lengths = pc.binary_length(array)
        longest = pc.max(lengths).as_py()
        if longest is None:
            return 0, None
        return longest, pc.index(lengths, longest).as_py()
    if pa.types.is_struct(kind):
        return max((_longest(array.field(i))[0] for i in range(kind.num_fields)),
                   default=0), None
    if pa.types.is_map(kind):
        return max(_longest(array.keys)[0], _longest(array.items)[0]), None
    if hasattr(array, "flatten") and hasattr(kind, "value_type"):
        return _longest(array.flatten())[0], None
    return 0, None


def _check_batch(batch, first_row: int, shown: str, limits: TableLimits) -> None:
    """A record batch: its buffers consistent (validate(full=True): no offset points outside
    its buffer, so reading a value cannot read stray memory), no cell too long. A length is
    in bytes, at least the characters it holds, so a cell within the limit passes."""
    try:
        batch.validate(full=True)
    except Exception as error:  # pyarrow.lib.ArrowInvalid, each with its own text
        raise InputError(f"{shown}: rows {first_row + 1}-{first_row + batch.num_rows}: not a "
                         f"consistent Arrow batch ({str(error)[:160]})") from None
    for name, column in zip(batch.schema.names, batch.columns):
        longest, row = _longest(column)
        if longest > limits.max_cell_chars:
            at = f"row {first_row + row + 1}: " if row is not None else ""
            raise over_limit(f'{shown}: {at}field "{name}"', f"a value of {longest} bytes",
                             limits, "max_cell_chars")


def check_parquet(path: Path, shown: str, limits: TableLimits, counter: RowCounter) -> None:
    """A parquet file: rows from its footer first, then each row group decoded alone."""
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        metadata = parquet.metadata
    except Exception as error:  # pyarrow raises ArrowInvalid / OSError with its own text
        raise InputError(f"{shown}: not a readable parquet file ({str(error)[:160]})") from None
    counter.add(metadata.num_rows, shown)
    _check_schema(parquet.schema_arrow, shown, limits)
    decoded, first_row = 0, 0
    for index in range(metadata.num_row_groups):
        group = metadata.row_group(index)
        decoded += max(group.total_byte_size, 0)
        if decoded > limits.max_bytes:
            raise over_limit(f"{shown}: row group {index + 1}", f"{decoded} bytes decoded "
                             "so far (the footer's sizes)", limits, "max_bytes")
        try:
            table = parquet.read_row_group(index)
        except Exception as error:
            raise InputError(f"{shown}: row group {index + 1}: cannot be decoded "
                             f"({str(error)[:160]})") from None
        for batch in table.to_batches():
            _check_batch(batch, first_row, shown, limits)
            first_row += batch.num_rows
    if first_row != metadata.num_rows:  # the footer's count is what the bound was held to
        raise InputError(f"{shown}: its footer says {metadata.num_rows} rows, its row groups "
                         f"hold {first_row}; not a consistent parquet file")


def check_arrow(path: Path, shown: str, limits: TableLimits, counter: RowCounter) -> None:
    """An Arrow IPC file (the stream format datasets writes, or the file format), one record
    batch at a time from a memory map: nothing is copied into memory but what a batch's
    checks compute."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except Exception:
            source.seek(0)
            try:
                file = pa.ipc.open_file(source)
            except Exception as error:
                raise InputError(f"{shown}: not an Arrow file ({str(error)[:160]})") from None
            reader = (file.get_batch(i) for i in range(file.num_record_batches))
            _check_schema(file.schema, shown, limits)
        else:
            _check_schema(reader.schema, shown, limits)
        first_row = 0
        try:
            for batch in reader:
                counter.add(batch.num_rows, f"{shown}: row {first_row + batch.num_rows}")
                _check_batch(batch, first_row, shown, limits)
                first_row += batch.num_rows
        except InputError:
            raise
        except Exception as error:
            raise InputError(f"{shown}: after row {first_row}: not a readable Arrow batch "
                             f"({str(error)[:160]})") from None


CHECKS = {"json": check_json, "csv": check_csv, "parquet": check_parquet, "arrow": check_arrow}
