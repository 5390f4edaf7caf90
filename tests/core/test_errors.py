"""CPU tier: the kernels' error record decodes into errors that name the rank, peer and limit."""

from __future__ import annotations

import numpy as np

from megatron_deepep.transport.errors import (ERROR_RECORD_WORDS, PeerTimeoutError,
                                              error_from_record)


def _record(code, rank, peer, phase, detail, expected, seen):
    words = np.zeros(ERROR_RECORD_WORDS, dtype=np.int32)
    words[:5] = (code, rank, peer, phase, detail)
    words[6:10] = np.array([expected, seen], dtype=np.int64).view(np.int32)
    return words


def test_no_error():
    assert error_from_record(np.zeros(ERROR_RECORD_WORDS, dtype=np.int32), 1.0) is None


def test_peer_timeout_names_the_stalled_peer():
    exc = error_from_record(_record(1, 2, 5, 3, 0, 41, 40), 3.0)
    assert isinstance(exc, PeerTimeoutError)
    assert "rank 2" in str(exc) and "peer 5 stalled" in str(exc) and "dispatch receive" in str(exc)


def test_layout_timeout_names_the_chunk_not_a_peer():
    exc = error_from_record(_record(1, 0, 0, 0, 17, 8, 6), 10.0)
    assert not isinstance(exc, PeerTimeoutError) and isinstance(exc, RuntimeError)
    assert "chunk 17" in str(exc) and "peer" not in str(exc)


def test_bad_expert_id_names_token_and_limit():
    exc = error_from_record(_record(2, 0, -1, 0, 2500, 64, 64), 1.0)
    assert isinstance(exc, ValueError)
    assert "expert id 64" in str(exc) and "token 2500" in str(exc) and "num_experts=64" in str(exc)
