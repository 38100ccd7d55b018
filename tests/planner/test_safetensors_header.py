"""A safetensors header is read only when the file is shaped as the format says (issue 40: a list-shaped or
2^62-long header was a 500 on the server; a copy cut short passed and killed the engine when it was read)."""

import json
import struct

import pytest

from shardserve.planner.tensors import HeaderError, safetensors_header

TENSORS = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
           "b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]}, "__metadata__": {"format": "pt"}}


def write(path, header, data_bytes: int = 40, length: int | None = None):
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + b"\0" * data_bytes)
    return path


def test_a_whole_file_is_read(tmp_path):
    header = safetensors_header(write(tmp_path / "ok.safetensors", TENSORS), whole=True)
    assert header["a"]["shape"] == [2, 3] and header["__metadata__"] == {"format": "pt"}


CASES = {
    "cut short": ({"header": TENSORS, "data_bytes": 30}, True, "is not whole: its tensors take 40 bytes"),
    "a list for a header": ({"header": b"[1, 2, 3]"}, False, "not an object"),
    "a header longer than the file": ({"header": TENSORS, "length": 2**62}, False, "would be 4611686018427387904"),
    "an entry without offsets": ({"header": {"a": {"dtype": "F32", "shape": [1]}}}, False, "data_offsets"),
    "not JSON": ({"header": b"{nope"}, False, "malformed"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_file_not_shaped_as_the_format_says_is_a_header_error(tmp_path, case):
    kwargs, whole, words = CASES[case]
    with pytest.raises(HeaderError) as caught:
        safetensors_header(write(tmp_path / "bad.safetensors", **kwargs), whole=whole)
    assert words in caught.value.reason and str(tmp_path) not in caught.value.reason


def test_a_header_only_file_is_still_read_where_the_data_is_not_needed(tmp_path):
    """The planner reads headers of checkpoints it only sizes: the data need not be there."""
    assert set(safetensors_header(write(tmp_path / "head.safetensors", TENSORS, data_bytes=0))) == set(TENSORS)
