"""The Rust in-place rotary kernel rejects bad shapes with a ValueError, touching nothing, and
arrays of mixed dtypes with a TypeError. (Its numbers against torch's formula, float32 and
bfloat16: tests/models/test_decoder_ops.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import _core


def test_tables_of_the_wrong_length_are_a_value_error():
    x = np.ones((3, 2, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="cos must be"):
        _core.cpu_rotary_in_place(x, np.ones((2, 4), np.float32), np.ones((2, 4), np.float32))
    assert (x == 1).all()


def test_an_odd_head_dim_is_a_value_error():
    x = np.ones((3, 2, 7), dtype=np.float32)
    with pytest.raises(ValueError, match="head_dim must be even"):
        _core.cpu_rotary_in_place(x, np.ones((3, 3), np.float32), np.ones((3, 3), np.float32))


def test_a_head_that_is_not_contiguous_is_a_value_error():
    x = np.ones((3, 2, 16), dtype=np.float32)[:, :, ::2]
    with pytest.raises(ValueError, match="contiguous within each head"):
        _core.cpu_rotary_in_place(x, np.ones((3, 4), np.float32), np.ones((3, 4), np.float32))


def test_tables_of_another_dtype_than_x_are_a_type_error():
    x = np.ones((3, 2, 8), dtype=np.uint16)  # bfloat16 bits
    with pytest.raises(TypeError, match=r"cos must be a 2-D uint16 \(bfloat16 bits\) array"):
        _core.cpu_rotary_in_place(x, np.ones((3, 4), np.float32), np.ones((3, 4), np.float32))
    assert (x == 1).all()
