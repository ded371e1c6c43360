"""Per-step scalars as TensorBoard event files, written without the `tensorboard` package.

torch.utils.tensorboard needs `tensorboard` installed; the format is small enough to write
ourselves. An events file is a TFRecord file: each record is

    uint64 length (little-endian) | uint32 masked CRC-32C of those 8 bytes | data | uint32 masked CRC-32C of data

and each `data` is a serialized `Event` protobuf, encoded here by hand. Field numbers are those of
tensorboard/compat/proto/event.proto and summary.proto:

    Event          { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary        { repeated Value value = 1; }
    Summary.Value  { string tag = 1; float simple_value = 2; }

The first record of a file carries only `file_version = "brain.Event:2"`. Every later record is
one training step: all of its scalars in one Summary. The file is flushed after every step so a
live TensorBoard shows progress. A resumed run opens a new file in the same directory;
TensorBoard reads every events file there as one run.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

FILE_VERSION = "brain.Event:2"
MASK_DELTA = 0xA282EAD8

# TensorBoard tag -> key of a training step record (training.py); list values are per optimizer
# step within the training step and are logged as their mean.
STEP_SCALARS = (
    ("train/reward", "mean_reward"),
    ("train/valid_group_ratio", "valid_group_ratio"),
    ("update/mean_kl", "mean_kl"),
    ("update/clip_fraction", "clip_fraction"),
    ("update/entropy", "entropy"),
    ("mismatch/mean_abs_logp", "mismatch_mean_abs_logp"),
    ("mismatch/max_abs_logp", "mismatch_max_abs_logp"),
    ("mismatch/k3_kl", "mismatch_k3_kl"),
    ("update/loss", "loss"),
    ("update/grad_norm", "grad_norm"),
    ("time/rollout_seconds", "rollout_seconds"),
    ("time/verification_seconds", "verification_seconds"),
    ("time/update_seconds", "update_seconds"),
    ("throughput/generation_tokens_per_second", "generation_tokens_per_second"),
)


class EventFileError(ValueError):
    """An events file that is truncated, fails a CRC check or holds a malformed protobuf."""


# --- CRC-32C (Castagnoli), as TFRecord uses it -----------------------------------------------


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # reflected polynomial
        table.append(crc)
    return tuple(table)


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotated right by 15 bits plus a constant, so that a CRC stored
    inside checksummed data does not make the outer CRC degenerate."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + MASK_DELTA) & 0xFFFFFFFF


def frame_record(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return (header + struct.pack("<I", masked_crc32c(header)) + data
            + struct.pack("<I", masked_crc32c(data)))


# --- protobuf encoding of Event / Summary ----------------------------------------------------


def _varint(value: int) -> bytes:
    value &= 0xFFFFFFFFFFFFFFFF  # int64: a negative value is its two's complement (10 bytes)
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length_delimited(field_number: int, payload: bytes) -> bytes:
    return _varint(field_number << 3 | 2) + _varint(len(payload)) + payload


def encode_event(wall_time: float, step: int, *, file_version: str | None = None,
                 scalars: dict[str, float] | None = None) -> bytes:
    """A serialized Event: wall_time and step, then either file_version or a Summary of
    simple_value scalars."""
    event = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        event += _length_delimited(3, file_version.encode("utf-8"))
    if scalars is not None:
        summary = b"".join(
            _length_delimited(1, _length_delimited(1, tag.encode("utf-8"))
                              + b"\x15" + struct.pack("<f", value))
            for tag, value in scalars.items())
        event += _length_delimited(5, summary)
    return event


# --- writer ---------------------------------------------------------------------------------


def event_file_name(wall_time: float, hostname: str) -> str:
    return f"events.out.tfevents.{int(wall_time)}.{hostname}.grpogate"


def step_scalars(record: dict) -> dict[str, float]:
    """The TensorBoard scalars of one training step record; a step with no optimizer step has
    no loss or grad_norm to show and leaves those tags out."""
    scalars = {}
    for tag, key in STEP_SCALARS:
        value = record.get(key)
        if isinstance(value, list):
            if not value:
                continue
            value = sum(value) / len(value)
        if value is not None:
            scalars[tag] = float(value)
    return scalars


class TensorBoardWriter:
    """Appends one Event per training step to a new events file in `log_dir`."""

    def __init__(self, log_dir: str | Path, *, clock=time.time, hostname: str | None = None):
        self.clock = clock
        directory = Path(log_dir)
        directory.mkdir(parents=True, exist_ok=True)
        name = event_file_name(clock(), hostname or socket.gethostname())
        # Two writers started in the same second (a quick resume) must not share a file.
        self.path, suffix = directory / name, 0
        while True:
            try:
                self._file = open(self.path, "xb")
                break
            except FileExistsError:
                suffix += 1
                self.path = directory / f"{name}.{suffix}"
        self._write(encode_event(clock(), 0, file_version=FILE_VERSION))

    def _write(self, event: bytes) -> None:
        self._file.write(frame_record(event))
        self._file.flush()

    def add_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self._write(encode_event(self.clock(), step, scalars=scalars))

    def write_step(self, record: dict) -> None:
        """The `on_step` callback of the training loop."""
        self.add_scalars(record["step"], step_scalars(record))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "TensorBoardWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# --- reader ---------------------------------------------------------------------------------


def read_records(path: str | Path) -> list[bytes]:
    """The data of every record in a TFRecord file, each checked against both of its CRCs."""
    blob = Path(path).read_bytes()
    records, position = [], 0
    while position < len(blob):
        header = blob[position:position + 12]
        if len(header) < 12:
            raise EventFileError(f"{path}: truncated record header at byte {position}")
        (length,), (length_crc,) = struct.unpack("<Q", header[:8]), struct.unpack("<I", header[8:])
        if masked_crc32c(header[:8]) != length_crc:
            raise EventFileError(f"{path}: length CRC mismatch at byte {position}")
        data = blob[position + 12:position + 12 + length]
        footer = blob[position + 12 + length:position + 16 + length]
        if len(data) < length or len(footer) < 4:
            raise EventFileError(f"{path}: truncated record at byte {position}")
        if masked_crc32c(data) != struct.unpack("<I", footer)[0]:
            raise EventFileError(f"{path}: data CRC mismatch in the record at byte {position}")
        records.append(data)
        position += 16 + length
    return records


def _fields(message: bytes) -> list[tuple[int, int, object]]:
    """(field number, wire type, value) of every field; unknown fields (as other writers add,
    e.g. Value.metadata) decode too and are ignored by the callers."""
    fields, position = [], 0

    def varint() -> int:
        nonlocal position
        value = shift = 0
        while True:
            if position >= len(message):
                raise EventFileError("malformed protobuf: truncated varint")
            byte = message[position]
            position += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    def take(size: int) -> bytes:
        nonlocal position
        if position + size > len(message):
            raise EventFileError("malformed protobuf: field runs past the end of its message")
        position += size
        return message[position - size:position]

    while position < len(message):
        key = varint()
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value = varint()
        elif wire_type == 1:
            value = take(8)
        elif wire_type == 2:
            value = take(varint())
        elif wire_type == 5:
            value = take(4)
        else:
            raise EventFileError(f"malformed protobuf: unsupported wire type {wire_type}")
        fields.append((number, wire_type, value))
    return fields


def decode_event(data: bytes) -> dict:
    """{"wall_time", "step", "file_version" (or None), "scalars": [(tag, value)]}."""
    event = {"wall_time": 0.0, "step": 0, "file_version": None, "scalars": []}
    for number, wire_type, value in _fields(data):
        if (number, wire_type) == (1, 1):
            event["wall_time"] = struct.unpack("<d", value)[0]
        elif (number, wire_type) == (2, 0):
            event["step"] = value - (1 << 64) if value >= 1 << 63 else value
        elif (number, wire_type) == (3, 2):
            event["file_version"] = value.decode("utf-8")
        elif (number, wire_type) == (5, 2):
            for summary_field, summary_wire, summary_value in _fields(value):
                if (summary_field, summary_wire) != (1, 2):
                    continue
                tag, simple_value = None, None
                for value_field, value_wire, content in _fields(summary_value):
                    if (value_field, value_wire) == (1, 2):
                        tag = content.decode("utf-8")
                    elif (value_field, value_wire) == (2, 5):
                        simple_value = struct.unpack("<f", content)[0]
                if tag is not None and simple_value is not None:
                    event["scalars"].append((tag, simple_value))
    return event


def read_scalars(path: str | Path) -> list[tuple[int, str, float]]:
    """Every simple_value scalar in an events file as (step, tag, value), in file order."""
    return [(event["step"], tag, value)
            for event in map(decode_event, read_records(path))
            for tag, value in event["scalars"]]

