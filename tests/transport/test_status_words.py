"""CPU tier: the host's reads of what the GPU publishes (`transport/status.py`).

Each HostInfo word carries its epoch (`host_word`), so the host takes the row count from the
very load that showed the epoch, and a per-expert size only next to that epoch. The mailbox
here is a plain array whose reads can be made stale, as a host whose loads reorder (Arm) may
see them.
"""

import numpy as np
import pytest

from megatron_deepep.transport import errors, status
from megatron_deepep.transport.status import KernelStatus
from tests.helpers.mirrors import host_word


class _Words:
    """The mailbox: a uint64 array; `stale[i]` old values are returned before the real one."""

    def __init__(self):
        self.now = np.zeros(status.HOST_INFO_U64, dtype=np.uint64)
        self.stale = {}

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self.now)))]
        queue = self.stale.get(index)
        if queue:
            return queue.pop(0)
        return self.now[index]


def _status(timeout_s=0.05):
    st = KernelStatus.__new__(KernelStatus)
    st.rank, st.locate, st.timeout_s = 0, None, timeout_s
    st._broken, st._published_epoch = None, None
    st._host_words = _Words()

    class _Record:
        words = np.zeros(errors.ERROR_RECORD_WORDS, dtype=np.int32)

    st._error_record = _Record()
    return st


def _publish(st, epoch, rows, per_expert):
    for e, value in enumerate(per_expert):
        st._host_words.now[1 + e] = host_word(value, epoch)
    st._host_words.now[0] = host_word(rows, epoch)


def test_row_count_comes_with_its_epoch():
    st = _status()
    _publish(st, 4, 96, [32, 64])
    _publish(st, 5, 40, [8, 32])
    # A stale load of the head word shows the old epoch: the host keeps waiting rather than
    # pairing epoch 5 with a row count of epoch 4.
    st._host_words.stale[0] = [np.uint64(host_word(96, 4))] * 3
    assert st.wait_num_rows(5) == 40
    assert st.tokens_per_expert(2) == [8, 32]


def test_stale_expert_sizes_are_read_again():
    st = _status()
    _publish(st, 7, 48, [16, 32])
    # The expert words' loads were satisfied before the head word's (reordered): old values.
    st._host_words.stale[1] = [np.uint64(host_word(99, 6))]
    st._host_words.stale[2] = [np.uint64(host_word(99, 6))] * 2
    assert st.wait_num_rows(7) == 48
    assert st.tokens_per_expert(2) == [16, 32]


def test_epochs_wrap_in_32_bits():
    st = _status()
    _publish(st, 0xFFFFFFFF, 3, [3])
    assert st.wait_num_rows(0xFFFFFFFF) == 3
    _publish(st, 0, 5, [5])
    assert st.wait_num_rows(1 << 32) == 5  # the transport's counter, past the wrap
    assert st.tokens_per_expert(1) == [5]


def test_expert_words_of_another_epoch_fail_naming_both(monkeypatch):
    monkeypatch.setattr(status, "HOST_WAIT_SLACK_S", 0.0)
    st = _status(timeout_s=0.01)
    _publish(st, 3, 8, [8])
    assert st.wait_num_rows(3) == 8
    st._host_words.now[1] = host_word(8, 2)
    with pytest.raises(RuntimeError, match="expert 0's row count carries epoch 2, the "
                                           "published layout 3"):
        st.tokens_per_expert(1)


def test_tokens_per_expert_needs_a_waited_layout():
    with pytest.raises(RuntimeError, match="no receive layout"):
        _status().tokens_per_expert(1)


def _mapped_status(num_words=status.HOST_INFO_U64):
    """A status whose mailbox is a ctypes uint64 array, as `KernelStatus` maps it."""
    import ctypes
    st = _status()
    st._host_words = np.ctypeslib.as_array((ctypes.c_uint64 * num_words)())
    return st


def test_tokens_per_expert_matches_the_word_by_word_unpack():
    st = _mapped_status()
    rng = np.random.default_rng(0)
    values = [int(v) for v in rng.integers(-(1 << 31), 1 << 31, size=256)]
    values[:4] = [0, -1, (1 << 31) - 1, -(1 << 31)]
    epoch = 0x89ABCDEF
    st._host_words[0] = host_word(sum(values[:2]), epoch)
    for e, value in enumerate(values):
        st._host_words[1 + e] = host_word(value, epoch)
    st.wait_num_rows(epoch)
    expected = [status.unpack_host_word(w)[0] for w in st._host_words[1:257]]
    got = st.tokens_per_expert(256)
    assert got == expected == values and all(type(v) is int for v in got)
    assert st.tokens_per_expert(3) == values[:3]


def test_negative_row_counts_keep_their_sign():
    st = _status()
    _publish(st, 9, 4, [-7, 3, -(1 << 31)])
    assert st.wait_num_rows(9) == 4
    assert st.tokens_per_expert(3) == [-7, 3, -(1 << 31)]


def test_stale_words_across_the_epoch_wrap_are_read_again():
    st = _status()
    _publish(st, 0, 12, [4, 8])  # the epoch after 0xFFFFFFFF
    st._host_words.stale[2] = [np.uint64(host_word(5, 0xFFFFFFFF))] * 3
    assert st.wait_num_rows(1 << 32) == 12
    assert st.tokens_per_expert(2) == [4, 8]
    _publish(st, 0xFFFFFFFF, 6, [2, 4])
    st._host_words.stale[1] = [np.uint64(host_word(1, 0xFFFFFFFE))]
    assert st.wait_num_rows((1 << 33) - 1) == 6
    assert st.tokens_per_expert(2) == [2, 4]
