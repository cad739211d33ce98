"""The disk tier's I/O pool: parts side by side, one future a job, jobs in the order submitted."""

import threading
import time

import pytest
from moecast.runtime.tiers.iopool import IOPool


def test_a_parted_job_is_done_only_when_every_part_is_and_its_parts_run_side_by_side():
    pool = IOPool(2)
    started, release = threading.Barrier(3), threading.Event()
    ran = []

    def part(i):
        started.wait(timeout=10)  # both parts must be running at once to pass the barrier
        release.wait(timeout=10)
        ran.append(i)
        return i

    try:
        fut = pool.submit_parts(part, [(0,), (1,)])
        started.wait(timeout=10)
        assert not fut.done()
        release.set()
        assert fut.result(timeout=10) in (0, 1)
        assert sorted(ran) == [0, 1]
        assert pool.submit_parts(part, []).result(timeout=1) is None  # no part: done at once
    finally:
        pool.shutdown()


def test_jobs_run_in_the_order_submitted():
    pool = IOPool(1)
    order = []
    try:
        futs = [pool.submit(order.append, i) for i in range(20)]
        for f in futs:
            f.result(timeout=10)
    finally:
        pool.shutdown()
    assert order == list(range(20))


def test_a_failed_part_fails_the_job_once_its_other_parts_ended():
    pool = IOPool(2)
    slow_done = threading.Event()

    def part(i):
        if i == 0:
            raise OSError("bad read")
        time.sleep(0.2)
        slow_done.set()

    try:
        fut = pool.submit_parts(part, [(0,), (1,)])
        with pytest.raises(OSError, match="bad read"):
            fut.result(timeout=10)
        # resolved only after the other part stopped writing into the caller's buffer
        assert slow_done.is_set()
        assert pool.submit(lambda: 7).result(timeout=10) == 7  # the threads survive a failure
    finally:
        pool.shutdown()


def test_a_job_whose_parts_all_fail_raises_the_first_failure_and_else_takes_the_last_parts_result():
    """One thread runs the parts in the order queued: part 0 ends (or fails) before part 1."""
    pool = IOPool(1)

    def failing(i):
        raise OSError(("first", "second")[i])

    try:
        with pytest.raises(OSError, match="first"):
            pool.submit_parts(failing, [(0,), (1,)]).result(timeout=10)
        assert pool.submit_parts(lambda i: i, [(0,), (1,)]).result(timeout=10) == 1
    finally:
        pool.shutdown()


def test_shutdown_runs_what_was_queued_then_refuses_new_jobs():
    pool = IOPool(2)
    done = []
    for i in range(6):
        pool.submit(lambda i=i: (time.sleep(0.01), done.append(i)))
    pool.shutdown(wait=True)
    assert sorted(done) == list(range(6))
    assert not any(w.is_alive() for w in pool._workers)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(print)
    pool.shutdown()  # twice is harmless


@pytest.mark.parametrize("threads", [1, 0])
def test_one_thread_or_fewer_runs_one_job_at_a_time(threads):
    """``threads`` 1 (and 0, raised to 1) is one worker: a second job waits for the first to end."""
    pool = IOPool(threads)
    release, ran = threading.Event(), []
    try:
        first = pool.submit(lambda: (release.wait(timeout=10), ran.append("first")))
        second = pool.submit(lambda: ran.append("second"))
        time.sleep(0.2)
        assert pool.threads == 1 and ran == [] and not second.done()
        release.set()
        first.result(timeout=10)
        second.result(timeout=10)
    finally:
        pool.shutdown()
    assert ran == ["first", "second"]
