"""The hand-written TensorBoard events format: CRC-32C, masking, Event encoding, write / read."""

import struct

import pytest

from grpogate.evidence.tensorboard import (EventFileError, TensorBoardWriter, crc32c, decode_event,
                                  encode_event, event_file_name, frame_record, masked_crc32c,
                                  read_records, read_scalars, step_scalars)


def float32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


class Clock:
    """A wall clock that advances one second per call, so every event has a known time."""

    def __init__(self, start: float):
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now - 1.0


def test_crc32c_check_values():
    assert crc32c(b"123456789") == 0xE3069283  # the published CRC-32C check value
    # RFC 3720 (iSCSI) appendix B.4 test vectors.
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E
    assert crc32c(b"") == 0


def test_masked_crc_of_check_string():
    # crc = 0xE3069283 = 1110 0011 0000 0110 1001 0010 1000 0011.
    # Rotated right by 15: the low 15 bits (001 0010 1000 0011) move to the top, giving
    # 0010 0101 0000 0111 1100 0110 0000 1101 = 0x2507C60D; plus 0xA282EAD8 = 0xC78AB0E5
    # (no carry out of 32 bits).
    assert masked_crc32c(b"123456789") == 0xC78AB0E5


def test_event_encoding_by_hand():
    # Event{wall_time: 1.5, step: 3, summary: {value: [{tag: "r", simple_value: 0.5}]}}
    expected = bytes([
        0x09,                                            # field 1 (wall_time), wire type 1 (64-bit)
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xF8, 0x3F,  # 1.5 as a little-endian double (0x3FF8 << 48)
        0x10,                                            # field 2 (step), wire type 0 (varint)
        0x03,                                            # 3
        0x2A,                                            # field 5 (summary), wire type 2 (bytes)
        0x0A,                                            # 10 bytes of Summary follow
        0x0A,                                            #   Summary field 1 (value), wire type 2
        0x08,                                            #   8 bytes of Value follow
        0x0A,                                            #     Value field 1 (tag), wire type 2
        0x01,                                            #     1 byte
        0x72,                                            #     "r"
        0x15,                                            #     Value field 2 (simple_value), wire type 5 (32-bit)
        0x00, 0x00, 0x00, 0x3F,                          #     0.5 as a little-endian float (0x3F000000)
    ])
    assert encode_event(1.5, 3, scalars={"r": 0.5}) == expected


def test_file_version_event_and_multibyte_step_by_hand():
    version = encode_event(2.0, 0, file_version="brain.Event:2")
    # 0x09 + double 2.0 (0x4000 << 48) | 0x10 0x00: step 0 | 0x1A: field 3 (file_version),
    # wire type 2, then 13 bytes of "brain.Event:2".
    assert version == (b"\x09" + bytes(7) + b"\x40" + b"\x10\x00" + b"\x1a\x0d" + b"brain.Event:2")
    # 300 = 0b10_0101100: low 7 bits 0101100 with the continuation bit -> 0xAC, then 0b10 -> 0x02.
    assert encode_event(0.0, 300, scalars={})[9:12] == b"\x10\xac\x02"


def test_record_framing():
    data = b"abc"
    record = frame_record(data)
    assert record[:8] == b"\x03" + bytes(7)  # uint64 length 3, little-endian
    assert record[8:12] == struct.pack("<I", masked_crc32c(b"\x03" + bytes(7)))
    assert record[12:15] == data
    assert record[15:] == struct.pack("<I", masked_crc32c(data))


def test_event_file_name():
    assert (event_file_name(1_700_000_000.9, "node-7.example")
            == "events.out.tfevents.1700000000.node-7.example.grpogate")


def test_writer_reader_round_trip(tmp_path):
    steps = [
        {"train/reward": 0.25, "update/mean_kl": 0.0123, "time/rollout_seconds": 4.2},
        {"train/reward": 0.375, "update/mean_kl": 0.0456, "time/rollout_seconds": 3.9},
        {"train/reward": 1 / 3, "update/mean_kl": 1e-7, "time/rollout_seconds": 123456.789},
    ]
    with TensorBoardWriter(tmp_path / "tb", clock=Clock(1_700_000_000.0), hostname="box") as writer:
        for step, scalars in zip((0, 1, 300), steps):
            writer.add_scalars(step, scalars)
    assert writer.path == tmp_path / "tb" / "events.out.tfevents.1700000000.box.grpogate"

    expected = [(step, tag, float32(value))
                for step, scalars in zip((0, 1, 300), steps) for tag, value in scalars.items()]
    assert read_scalars(writer.path) == expected

    events = [decode_event(data) for data in read_records(writer.path)]
    assert events[0]["file_version"] == "brain.Event:2" and events[0]["scalars"] == []
    # The clock is read once for the file name, then once per event.
    assert [e["wall_time"] for e in events] == [1_700_000_001.0, 1_700_000_002.0,
                                                1_700_000_003.0, 1_700_000_004.0]
    assert [e["step"] for e in events] == [0, 0, 1, 300]


def test_each_step_is_flushed(tmp_path):
    writer = TensorBoardWriter(tmp_path, clock=Clock(10.0), hostname="box")
    writer.add_scalars(0, {"train/reward": 0.5})
    # Still open: a live TensorBoard must already see the step.
    assert read_scalars(writer.path) == [(0, "train/reward", 0.5)]
    writer.close()


def test_a_second_writer_in_the_same_second_gets_its_own_file(tmp_path):
    first = TensorBoardWriter(tmp_path, clock=lambda: 5.0, hostname="box")
    first.add_scalars(0, {"train/reward": 0.25})
    first.close()
    second = TensorBoardWriter(tmp_path, clock=lambda: 5.0, hostname="box")
    second.add_scalars(1, {"train/reward": 0.75})
    second.close()
    assert first.path.name == "events.out.tfevents.5.box.grpogate"
    assert second.path.name == "events.out.tfevents.5.box.grpogate.1"
    assert read_scalars(first.path) == [(0, "train/reward", 0.25)]
    assert read_scalars(second.path) == [(1, "train/reward", 0.75)]


def test_step_record_scalars(tmp_path):
    record = {"step": 4, "mean_reward": 0.5, "valid_group_ratio": 0.75, "mean_kl": 0.01,
              "clip_fraction": 0.125, "loss": [0.5, -0.25], "grad_norm": [2.0, 1.0, 3.0],
              "rollout_seconds": 8.0, "verification_seconds": 0.5, "update_seconds": 4.0,
              "generation_tokens_per_second": 96.0, "policy_version": "abc", "tokens": 100}
    assert step_scalars(record) == {
        "train/reward": 0.5, "train/valid_group_ratio": 0.75, "update/mean_kl": 0.01,
        "update/clip_fraction": 0.125, "update/loss": 0.125, "update/grad_norm": 2.0,
        "time/rollout_seconds": 8.0, "time/verification_seconds": 0.5,
        "time/update_seconds": 4.0, "throughput/generation_tokens_per_second": 96.0}
    # A step without an optimizer step has no loss or grad_norm to show.
    assert "update/loss" not in step_scalars(record | {"loss": [], "grad_norm": []})

    with TensorBoardWriter(tmp_path, clock=Clock(0.0), hostname="box") as writer:
        writer.write_step(record)
    read = read_scalars(writer.path)
    assert {step for step, _, _ in read} == {4}
    assert {tag: value for _, tag, value in read} == {
        tag: float32(value) for tag, value in step_scalars(record).items()}


@pytest.mark.parametrize("where", ["length", "length_crc", "data", "data_crc"])
def test_a_corrupted_byte_is_refused(tmp_path, where):
    with TensorBoardWriter(tmp_path, clock=Clock(0.0), hostname="box") as writer:
        writer.add_scalars(0, {"train/reward": 0.5})
    blob = bytearray(writer.path.read_bytes())
    first_length = struct.unpack("<Q", blob[:8])[0]
    second = 16 + first_length  # the scalar record follows the file_version record
    offset = {"length": 0, "length_crc": 8, "data": 14, "data_crc": 12 + first_length}[where]
    blob[second + offset] ^= 0x01
    writer.path.write_bytes(bytes(blob))
    with pytest.raises(EventFileError):
        read_scalars(writer.path)


def test_a_truncated_file_is_refused(tmp_path):
    with TensorBoardWriter(tmp_path, clock=Clock(0.0), hostname="box") as writer:
        writer.add_scalars(0, {"train/reward": 0.5})
    writer.path.write_bytes(writer.path.read_bytes()[:-3])
    with pytest.raises(EventFileError, match="truncated"):
        read_scalars(writer.path)
