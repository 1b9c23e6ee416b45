"""runtime/inputs.py: the padded prefill/decode inputs the runner, tools.verify and
tools.dump_inputs share (docs/abi.md)."""

import numpy as np
import pytest

from sharkport.errors import SharkportError
from sharkport.runtime.inputs import decode_inputs, pick_batch_size, prefill_inputs


def test_pick_batch_size():
    assert pick_batch_size([4, 1], 1, "prefill") == 1
    assert pick_batch_size([4, 1], 2, "prefill") == 4
    assert pick_batch_size([4, 1], 9, "prefill") == 4  # the caller splits into calls of 4
    with pytest.raises(SharkportError, match="exports no decode function; re-export with --bs-decode"):
        pick_batch_size([], 1, "decode")


def test_prefill_pads_rows_and_blocks_onto_the_scratch_page():
    tokens, lens, ids = prefill_inputs([[5, 6, 7, 8, 9], [3]], [[1, 2, 3], [4]], batch_size=4, stride=4, scratch=0)
    np.testing.assert_array_equal(tokens, [[5, 6, 7, 8, 9, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0, 0],
                                           [0] * 8, [0] * 8])
    np.testing.assert_array_equal(lens, [5, 1, 1, 1])
    np.testing.assert_array_equal(ids, [[1, 2], [4, 0], [0, 0], [0, 0]])
    assert tokens.dtype == lens.dtype == ids.dtype == np.int64


def test_decode_table_reaches_the_furthest_position():
    tokens, seq_lens, start, ids = decode_inputs([11, 12], [8, 2], [[1, 2, 3], [4]], batch_size=4, stride=4,
                                                 scratch=0)
    np.testing.assert_array_equal(tokens, [[11], [12], [0], [0]])
    np.testing.assert_array_equal(start, [8, 2, 0, 0])
    np.testing.assert_array_equal(seq_lens, [9, 3, 1, 1])
    np.testing.assert_array_equal(ids, [[1, 2, 3], [4, 0, 0], [0, 0, 0], [0, 0, 0]])
    assert tokens.dtype == seq_lens.dtype == start.dtype == ids.dtype == np.int64
