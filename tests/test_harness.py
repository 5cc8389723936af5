"""The multi-rank harness itself: failures and hangs on any rank surface as test failures, fast."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from bigdense.testing import RankError, run_ranks


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def test_results_come_back_in_rank_order():
    assert run_ranks(_rank_and_sum, 3) == [(0, 6.0), (1, 6.0), (2, 6.0)]


def _rank_one_raises():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 waits for a peer that will never come


def test_an_exception_on_one_rank_fails_the_run_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 of 2 failed first") as info:
        run_ranks(_rank_one_raises, 2, timeout=60)
    assert "boom on rank one" in str(info.value)
    assert time.monotonic() - start < 30  # the stuck peer is killed after a short grace period


def _rank_zero_hangs():
    if dist.get_rank() == 0:
        time.sleep(3600)


def test_a_hanging_rank_is_killed_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"ranks \[0\] of 2 did not finish within 3s"):
        run_ranks(_rank_zero_hangs, 2, timeout=3)
    assert time.monotonic() - start < 20


def _rank_one_dies():
    if dist.get_rank() == 1:
        os._exit(7)
    return "alive"


def test_a_rank_that_dies_is_reported():
    with pytest.raises(RankError, match="died without reporting"):
        run_ranks(_rank_one_dies, 2, timeout=60)


def _stuck_collective():
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins; the collective timeout must fire
    else:
        time.sleep(60)  # alive (an exit would reset the connection and end the barrier at once)


def test_a_collective_that_never_completes_times_out_inside_the_rank():
    start = time.monotonic()
    with pytest.raises(RankError, match="(?is)rank 0 of 2 failed first.*timed out"):
        run_ranks(_stuck_collective, 2, timeout=60, collective_timeout=2)
    assert 2 <= time.monotonic() - start < 30


def _never_called():
    raise AssertionError("fn must not run when the process group could not be created")


def test_a_failed_rendezvous_is_retried_once_then_reported():
    start = time.monotonic()
    # Nothing listens on port 1: every rank's init_process_group fails, on both attempts.
    with pytest.raises(RankError, match="(?s)failed first.*init_process_group"):
        run_ranks(_never_called, 2, timeout=60, collective_timeout=2, env={"MASTER_PORT": "1"})
    assert time.monotonic() - start < 40
