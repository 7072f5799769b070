"""The writer process's sleep between polls (writer_process._Pacer) and the byte count it
paces by (RingView.part_read): a slow producer lets it sleep IDLE_POLL_BATCH_S and take a few
steps a wake; a fast one cuts the sleep so that it fills at most SLEEP_RING_SHARE of the ring."""

from __future__ import annotations

import pytest

from hstrace.trace.write import writer_process as wp
from hstrace.trace.write.ring import RingView

RING = 256 << 20


def test_a_slow_producer_lets_the_writer_sleep_the_batch_period():
    pacer = wp._Pacer(RING, read=0, now=100.0)
    # a tiny-world step (~100 KB) every 10 ms: 2 MB in the 20 ms since the last batch
    assert pacer.after_batch(2 << 20, 100.02) == wp.IDLE_POLL_BATCH_S


def test_a_fast_producer_cuts_the_sleep_to_a_share_of_the_ring():
    pacer = wp._Pacer(RING, read=0, now=100.0)
    # 256 MiB in 40 ms (6.4 GB/s): a sleep may take only SLEEP_RING_SHARE of the ring
    pause = pacer.after_batch(RING, 100.04)
    assert pause == pytest.approx(0.04 * wp.SLEEP_RING_SHARE)
    assert wp.IDLE_POLL_MIN_S < pause < wp.IDLE_POLL_BATCH_S
    # the rate is per batch: the next one is measured from this one
    assert pacer.after_batch(RING + (1 << 20), 100.06) == wp.IDLE_POLL_BATCH_S


def test_the_sleep_never_goes_under_the_floor_and_nothing_staged_sleeps_the_period():
    pacer = wp._Pacer(RING, read=0, now=100.0)
    assert pacer.after_batch(64 * RING, 100.001) == wp.IDLE_POLL_MIN_S
    assert pacer.after_batch(64 * RING, 100.002) == wp.IDLE_POLL_BATCH_S  # no bytes: a pipe message
    assert pacer.after_batch(65 * RING, 100.002) == wp.IDLE_POLL_BATCH_S  # no time (clock step)


def test_part_read_counts_the_parts_not_the_head_counter_jumps():
    ring = object.__new__(RingView)
    ring.size, ring.bytes_read = 1000, 0
    # (ring position, producer counter after the part): a part ending at the ring's end, the
    # next one after the producer's jump to the ring's start (nothing was in flight), a part
    # padded to the start because it did not fit before the end
    parts = [(0, 300), (300, 1000), (0, 2200), (200, 2900), (0, 3400)]
    for offset, end in parts:
        ring.part_read(offset, end)
    assert ring.bytes_read == 300 + 700 + 200 + 700 + 400
