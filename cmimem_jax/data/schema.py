"""Small schema checks shared by the loaders, all raising `DatasetError`."""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Iterator
from typing import Any

from cmimem_jax import storage
from cmimem_jax.data.types import DatasetError


def read_json(path: str) -> Any:
  """Reads a JSON document, or JSON Lines when the file is not one document
  (a local file or an object: `gs://...`)."""
  try:
    text = storage.path(path).read_bytes().decode("utf-8")
  except storage.StorageError:
    raise
  except OSError as e:
    raise DatasetError(path, None, None, f"cannot read file: {e}") from e
  try:
    return json.loads(text)
  except json.JSONDecodeError as whole_error:
    rows = []
    for line_no, line in enumerate(text.splitlines(), start=1):
      if not line.strip():
        continue
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        raise DatasetError(
            path, None, None,
            f"not valid JSON ({whole_error}) nor JSON Lines (line {line_no})"
        ) from whole_error
    return rows


class RecordReader:
  """Typed field access on one raw record with errors that name where."""

  def __init__(self, path: str, record_id: str | int, record: Any,
               prefix: str = ""):
    self.path = path
    self.record_id = record_id
    self.prefix = prefix  # Where a nested object sits, e.g. "qa[3]".
    if not isinstance(record, dict):
      self.fail(None, f"expected an object, got {type(record).__name__}")
    self.record = record

  def nested(self, field: str, value: Any) -> RecordReader:
    """A reader for an object nested under `field` of this record."""
    return RecordReader(self.path, self.record_id, value,
                        prefix=self._where(field))

  def _where(self, field: str | None) -> str | None:
    if not self.prefix:
      return field
    return self.prefix if field is None else f"{self.prefix}.{field}"

  def fail(self, field: str | None, message: str) -> None:
    raise DatasetError(self.path, self.record_id, self._where(field), message)

  def get(self, field: str, types: type | tuple[type, ...],
          required: bool = True, default: Any = None) -> Any:
    value = self.record.get(field)
    if value is None:  # Parquet stores absent struct fields as null.
      if required:
        self.fail(field, "missing")
      return default
    allowed = types if isinstance(types, tuple) else (types,)
    # bool is an int subclass; a JSON `true` is never a valid count or id.
    if not isinstance(value, allowed) or (isinstance(value, bool)
                                          and bool not in allowed):
      names = " or ".join(t.__name__ for t in allowed)
      self.fail(field, f"expected {names}, got {type(value).__name__}")
    return value

  def get_list(self, field: str, item_types: type | tuple[type, ...],
               required: bool = True) -> list[Any]:
    values = self.get(field, list, required=required, default=[])
    for i, value in enumerate(values):
      if not isinstance(value, item_types):
        self.fail(f"{field}[{i}]", f"unexpected {type(value).__name__}")
    return values


def iter_records(path: str, id_field: str) -> Iterator[RecordReader]:
  """Readers for the records of a JSON list file, each named by `id_field`
  once it is read (errors before that name the record's index)."""
  data = read_json(path)
  if not isinstance(data, list):
    raise DatasetError(path, None, None, "expected a list of records")
  for index, raw in enumerate(data):
    reader = RecordReader(path, index, raw)
    reader.record_id = reader.get(id_field, str)
    yield reader


_LOCOMO_DATE = re.compile(
    r"^\s*(\d{1,2}):(\d{2})\s*([ap]m)\s+on\s+(\d{1,2})\s+([A-Za-z]+),?\s+(\d{4})\s*$",
    re.IGNORECASE)
_LONGMEMEVAL_DATE = re.compile(
    r"^\s*(\d{4})/(\d{2})/(\d{2})(?:\s*\(\w+\))?(?:\s+(\d{1,2}):(\d{2}))?\s*$")


def parse_date(text: str) -> dt.datetime:
  """Parses the date formats the benchmarks use.

  Accepts LoCoMo ("1:56 pm on 8 May, 2023"), LongMemEval
  ("2023/05/25 (Thu) 20:21") and ISO 8601. Raises ValueError otherwise.
  """
  match = _LOCOMO_DATE.match(text)
  if match:
    hour, minute, ampm, day, month, year = match.groups()
    clock = dt.datetime.strptime(f"{hour}:{minute} {ampm.upper()}", "%I:%M %p")
    month_number = dt.datetime.strptime(month[:3].title(), "%b").month
    return dt.datetime(int(year), month_number, int(day), clock.hour,
                       clock.minute)
  match = _LONGMEMEVAL_DATE.match(text)
  if match:
    year, month, day, hour, minute = match.groups()
    return dt.datetime(int(year), int(month), int(day), int(hour or 0),
                       int(minute or 0))
  return dt.datetime.fromisoformat(text.strip())


def parse_date_field(reader: RecordReader, field: str,
                     text: str) -> dt.datetime:
  try:
    return parse_date(text)
  except ValueError:
    reader.fail(field, f"unrecognised date {text!r}")
    raise  # Unreachable: fail() raises.
