"""The fused NVLink kernels' error codes decode into messages that name what went wrong."""

import numpy as np

from megatron_deepep.transport import errors


def _record(code, rank, peer, phase, detail, expected, seen):
    words = np.zeros(errors.ERROR_RECORD_WORDS, dtype=np.int32)
    words[:5] = (code, rank, peer, phase, detail)
    words[6:10] = np.array([expected, seen], dtype=np.int64).view(np.int32)
    return words


def test_bad_peer_row_names_the_source_the_entry_and_the_position():
    seen = (5 << 32) + 77  # local expert 5, position 77
    exc = errors.error_from_record(
        _record(errors.CODE_BAD_PEER_ROW, 1, 3, 3, 6, 16, seen), 100.0)
    assert isinstance(exc, RuntimeError)
    text = str(exc)
    assert "rank 1 received from rank 3" in text and "entry 6" in text
    assert "local expert 5, position 77" in text and "not written" in text


def test_concurrent_call_names_the_rank_and_what_to_do():
    exc = errors.error_from_record(
        _record(errors.CODE_CONCURRENT_CALL, 2, -1, 3, 25, 24, 41), 100.0)
    text = str(exc)
    assert "rank 2 ran two calls of one Buffer at once" in text
    assert "epoch (41)" in text and "dispatch receive" in text
    assert "CUDA-graph replay" in text


def test_codes_match_the_kernels_enum():
    from megatron_deepep.kernels import jit
    text = (jit.cuda_src_dir() / "common" / "error.cuh").read_text()
    assert f"kErrBadPeerRow = {errors.CODE_BAD_PEER_ROW}," in text
    assert f"kErrConcurrentCall = {errors.CODE_CONCURRENT_CALL}," in text
