"""The input tensors the embedded server's requests carry (serving_image/triton/capi/inference.py `Input`): packed
from flat values without numpy, byte for byte what the numpy path packs."""

from __future__ import annotations

import numpy as np
import pytest

from serving_image.triton.capi.inference import NUMPY_DTYPES, Input


@pytest.mark.parametrize(("datatype", "shape", "values"), [
    ("BOOL", (1,), (True,)), ("BOOL", (3,), (True, False, True)), ("INT32", (2, 2), (1, -2, 3, 2**31 - 1)),
    ("INT64", (2,), (-(2**63), 2**63 - 1)), ("UINT8", (4,), (0, 1, 254, 255)), ("UINT32", (1,), (7,)),
    ("FP32", (3,), (0.5, -1.25, 3.0)), ("FP64", (1,), (1e300,)), ("FP16", (2,), (1.5, -2.0)),
    ("INT8", (2,), (-128, 127)), ("UINT64", (1,), (2**64 - 1,)),
])
def test_numbers_and_booleans_pack_as_numpy_packs_them(datatype, shape, values):
    expected = Input.from_numpy("x", np.array(values, dtype=NUMPY_DTYPES[datatype]).reshape(shape))
    assert Input.from_values("x", datatype, shape, values) == expected


def test_bytes_and_text_pack_as_numpy_object_arrays_do():
    values = (b"abc", "ñandú", b"", b"\x00\xff")
    expected = Input.from_numpy("t", np.array([v.encode() if isinstance(v, str) else v for v in values],
                                              dtype=np.object_).reshape(2, 2))
    assert Input.from_values("t", "BYTES", (2, 2), values) == expected


def test_values_that_do_not_fill_the_shape_are_refused_naming_the_input():
    with pytest.raises(ValueError, match=r"input 'flags': 2 values for shape \[3\]"):
        Input.from_values("flags", "BOOL", (3,), (True, False))
