"""Buffer calls stay in issue order across streams (`buffer.CallOrder`), on fake streams.

Every call of a Buffer shares the transport's epoch words and block counters, so two calls in
flight at once race. The fake streams below log launches, event records and waits; a
happens-before graph built from the log must order every pair of launches.
"""

import itertools

import pytest
import torch

from megatron_deepep import buffer as buffer_module
from megatron_deepep import ops
from megatron_deepep.buffer import Buffer, CallOrder


class _Log:
    def __init__(self):
        self.entries = []  # (stream name, kind, payload)
        self.launch_stream = None


class FakeEvent:
    _ids = itertools.count()

    def __init__(self, log: _Log):
        self.log, self.id, self.recorded = log, next(self._ids), False

    def record(self, stream):
        self.recorded = True
        self.log.entries.append((stream.name, "record", self.id))

    def wait(self, stream):
        stream.wait_event(self)


class FakeStream:
    _handles = itertools.count(1)

    def __init__(self, name: str, log: _Log):
        self.name, self.log, self.cuda_stream = name, log, next(self._handles)

    def wait_event(self, event):
        assert event.recorded, "a wait on an event never recorded orders nothing"
        self.log.entries.append((self.name, "wait", event.id))

    def wait_stream(self, other):
        event = FakeEvent(self.log)
        event.record(other)
        self.wait_event(event)


def _ordered_pairs(entries):
    """Launch names (a, b) with a happening before b: stream order plus record -> wait."""
    nodes = list(range(len(entries)))
    edges = {i: set() for i in nodes}
    last_on = {}
    record_at = {}
    for i, (stream, kind, payload) in enumerate(entries):
        if stream in last_on:
            edges[last_on[stream]].add(i)
        last_on[stream] = i
        if kind == "record":
            record_at[payload] = i
        elif kind == "wait":
            edges[record_at[payload]].add(i)
    reach = {}
    for i in reversed(nodes):
        seen = set()
        for j in edges[i]:
            seen |= {j} | reach[j]
        reach[i] = seen
    launches = [i for i, e in enumerate(entries) if e[1] == "launch"]
    return {(entries[a][2], entries[b][2]) for a in launches for b in launches
            if b in reach[a]}, [entries[i][2] for i in launches]


@pytest.fixture
def fake_buffer(monkeypatch):
    log = _Log()
    streams = {name: FakeStream(name, log) for name in ("comm", "compute", "side")}
    current = {"stream": streams["compute"]}

    class _Transport:
        graph_capture_refusal = None

    buf = Buffer.__new__(Buffer)
    buf._comm_stream = streams["comm"]
    buf._call_order = CallOrder(lambda: FakeEvent(log))
    buf._transport = _Transport()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: current["stream"])
    monkeypatch.setattr(ops, "current_raw_stream", lambda: current["stream"])
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(log))
    monkeypatch.setattr(buffer_module, "is_capturing", lambda: False)

    class _LaunchOn:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            log.launch_stream = self.stream

        def __exit__(self, *exc):
            log.launch_stream = None

    monkeypatch.setattr(ops, "launch_on", _LaunchOn)

    def call(name, stream="compute", async_finish=False, previous_event=None):
        current["stream"] = streams[stream]

        def fn():
            target = log.launch_stream or current["stream"]
            log.entries.append((target.name, "launch", name))
            return name
        return buf._run(fn, [], previous_event, async_finish)[1]

    return call, log


def _assert_all_ordered(log):
    pairs, names = _ordered_pairs(log.entries)
    for a, b in zip(names, names[1:]):
        assert (a, b) in pairs, f"{a} and {b} may run at the same time: {log.entries}"


def test_sync_call_after_an_async_one_waits_for_it(fake_buffer):
    call, log = fake_buffer
    call("dispatch 0 (async)", async_finish=True)
    call("dispatch 1 (sync)")
    call("combine 1 (sync)")
    call("combine 0 (async)", async_finish=True)
    _assert_all_ordered(log)


def test_overlapped_micro_batches_on_two_caller_streams_stay_ordered(fake_buffer):
    # Megatron's overlap: dispatch of n + 1 on one stream while combine of n on another.
    call, log = fake_buffer
    for n in range(3):
        call(f"dispatch {n + 1}", stream="side")
        call(f"combine {n}", stream="compute")
    _assert_all_ordered(log)


def test_async_call_with_previous_event_still_waits_for_the_last_sync_call(fake_buffer):
    call, log = fake_buffer
    call("layout", stream="side")
    event = FakeEvent(log)
    event.record(FakeStream("elsewhere", log))
    from megatron_deepep.events import EventHandle
    call("dispatch", async_finish=True, previous_event=EventHandle(event))
    _assert_all_ordered(log)


def test_calls_on_one_stream_add_no_waits(fake_buffer):
    call, log = fake_buffer
    for n in range(4):
        call(f"call {n}")
    assert not [e for e in log.entries if e[1] == "wait"]
    _assert_all_ordered(log)


def test_capture_waits_only_on_events_of_the_same_capture():
    log = _Log()
    a, b = FakeStream("a", log), FakeStream("b", log)
    order = CallOrder(lambda: FakeEvent(log))
    order.after(a, capture=None)     # eager call
    order.before(b, capture=7)       # first call of capture 7: no wait on eager work
    order.after(b, capture=7)
    order.before(a, capture=8)       # another capture: no wait on capture 7
    order.after(a, capture=8)
    order.before(b, capture=8)       # same capture, other stream: waits
    assert [e[1] for e in log.entries].count("wait") == 1
    order.before(a, capture=CallOrder.UNKNOWN_CAPTURE)
    order.after(a, capture=CallOrder.UNKNOWN_CAPTURE)
    assert [e[1] for e in log.entries].count("wait") == 1


def test_eager_calls_reuse_one_event_per_stream_and_captures_get_their_own():
    log, made = _Log(), []

    def new_event():
        made.append(FakeEvent(log))
        return made[-1]

    a, b = FakeStream("a", log), FakeStream("b", log)
    order = CallOrder(new_event)
    for stream in (a, b, a, b, a):
        order.before(stream)
        log.entries.append((stream.name, "launch", len(log.entries)))
        order.after(stream)
    assert len(made) == 2  # one per stream, re-recorded by each later call on it
    # Each wait names the event the previous call recorded last: every launch stays ordered.
    _assert_all_ordered(log)
    order.before(a, capture=5)
    order.after(a, capture=5)
    order.after(a, capture=5)
    assert len(made) == 4  # a capture never records an eager event
    order.after(a)
    assert len(made) == 4 and order._last[0] is made[0]


def test_raw_event_records_and_waits_by_raw_handles(monkeypatch):
    """CallOrder's event: made once at its first record, then recorded on and waited for by
    the streams' raw handles (no torch Stream object), each status checked."""
    from cuda.bindings import driver

    from megatron_deepep.kernels import cuda_calls
    calls = []
    ok = driver.CUresult.CUDA_SUCCESS
    monkeypatch.setattr(driver, "cuEventCreate",
                        lambda flags: calls.append(("create", int(flags))) or (ok, "ev"))
    monkeypatch.setattr(driver, "cuEventRecord",
                        lambda ev, stream: calls.append(("record", ev, stream)) or (ok,))
    monkeypatch.setattr(driver, "cuStreamWaitEvent",
                        lambda stream, ev, flags: calls.append(("wait", stream, ev)) or (
                            driver.CUresult.CUDA_ERROR_INVALID_HANDLE,))
    monkeypatch.setattr(driver, "cuEventDestroy", lambda ev: calls.append(("destroy", ev)))

    class _Raw:
        def __init__(self, handle):
            self.cuda_stream, self.device_index = handle, 0

    event = cuda_calls.RawEvent()
    event.record(_Raw(11))
    event.record(_Raw(12))
    disable_timing = int(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    assert calls == [("create", disable_timing), ("record", "ev", 11), ("record", "ev", 12)]
    with pytest.raises(cuda_calls.CudaError, match="cuStreamWaitEvent.*INVALID_HANDLE"):
        event.wait(_Raw(13))
    del event
    assert calls[-2:] == [("wait", 13, "ev"), ("destroy", "ev")]
