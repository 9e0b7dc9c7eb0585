"""The batch prefetcher: order, end, errors reaching the loop unchanged, and that it reads ahead."""

import threading
import time

import pytest
import torch

from kiln.core.prefetch import DevicePrefetcher

CPU = torch.device("cpu")


def test_yields_every_item_in_order_then_stops_for_good():
    items = [torch.tensor([i]) for i in range(5)]
    pf = DevicePrefetcher(iter(items), CPU, depth=2)
    assert [int(t) for t in pf] == [0, 1, 2, 3, 4]
    with pytest.raises(StopIteration):
        next(pf)  # asked again after the end: still the end, not a hang
    pf.close()


def test_empty_source_yields_nothing():
    assert list(DevicePrefetcher(iter([]), CPU)) == []


def test_fetch_error_is_reraised_where_it_happened():
    def broken():
        yield torch.tensor([0])
        raise OSError("shard s3://bucket/part-0.parquet unreadable")

    pf = DevicePrefetcher(broken(), CPU)
    assert int(next(pf)) == 0
    with pytest.raises(OSError, match="part-0.parquet"):
        next(pf)


def test_reads_ahead_while_the_step_computes_and_close_stops_the_thread():
    fetched = []

    def slow():
        for i in range(100):
            time.sleep(0.05)  # a read
            fetched.append(i)
            yield torch.tensor([i])

    pf = DevicePrefetcher(slow(), CPU, depth=3)
    time.sleep(0.5)  # the "step": the thread reads meanwhile, up to depth (+1 in its hand)
    assert 3 <= len(fetched) <= 5, fetched  # read before anyone asked, and no further than depth
    assert [int(next(pf)) for _ in range(3)] == [0, 1, 2]
    pf.close()
    assert not any(t.name == "kiln-prefetch" and t.is_alive() for t in threading.enumerate())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches_arrive_pinned_copied_and_equal():
    items = [torch.arange(i, i + 8).reshape(2, 4) for i in range(4)]
    pf = DevicePrefetcher(iter(items), torch.device("cuda"), depth=2)
    got = [t for t in pf]
    assert all(t.is_cuda for t in got)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, items))


def test_phase_timer_sums_each_phase_and_reads_nothing_when_off():
    from kiln.core.step import PHASES, PhaseTimer

    timer = PhaseTimer(CPU)
    for _ in range(2):  # two micro-batches
        timer.start()
        time.sleep(0.02)
        timer.lap("time/forward_s")
        timer.lap("time/backward_s")
        time.sleep(0.01)
        timer.lap("time/optimizer_s")
    got = timer.read()
    assert set(got) == set(PHASES)
    assert got["time/forward_s"] >= 0.04 and got["time/optimizer_s"] >= 0.02
    assert got["time/backward_s"] < got["time/optimizer_s"]
    timer.on = False
    timer.start()
    timer.lap("time/forward_s")
    assert timer.read() == dict.fromkeys(PHASES, 0.0)
