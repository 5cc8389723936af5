"""Run a function on N CPU processes with a gloo process group: how bigdense simulates a cluster.

``run_ranks(fn, 4, *args)`` starts 4 processes, gives each the environment torchrun would
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), initialises gloo with a timeout on every
collective, calls ``fn(*args)`` and returns the per-rank results in rank order. The first failure
on any rank (the first to report, usually the cause) is raised here with that rank's traceback; a rank that is still running at the
deadline is killed and reported. Nothing can hang the caller.

The rendezvous store is hosted by the calling process on a port the OS picks (port 0), so there
is no race for a "free port"; ranks join it the way torchrun's workers join the agent's store.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable

import torch
import torch.distributed as dist

# After one rank fails, how long the others get to report before they are killed: they are
# usually blocked in a collective the failed rank will never join.
FAILURE_GRACE_S = 3.0


class RankError(RuntimeError):
    """A rank raised, crashed or ran out of time; the message holds its traceback."""


def _rank_main(rank, world_size, port, fn, args, kwargs, conn, init_process_group, collective_timeout, env, gate):
    # Wait until every rank is forked: a rank forked while the parent's store thread serves an
    # earlier rank's connection can inherit glibc's resolver lock held, and then hangs forever in
    # getnameinfo when it connects to the store itself.
    if not gate.wait(collective_timeout):
        os._exit(1)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
        # Join the store the parent hosts instead of rank 0 serving one (as under torchrun's agent).
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    os.environ.update(env)
    status, payload = "error", None
    try:
        torch.set_num_threads(1)
        if init_process_group:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=collective_timeout))
    except BaseException:  # noqa: BLE001 - the rendezvous failed: the parent may retry the run
        status, payload = "init_error", traceback.format_exc()
    else:
        try:
            status, payload = "ok", fn(*args, **kwargs)
        except BaseException:  # noqa: BLE001 - every failure must reach the parent
            status, payload = "error", traceback.format_exc()
    try:
        conn.send_bytes(pickle.dumps((status, payload)))
    except Exception:  # noqa: BLE001 - an unpicklable result is a failure too
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        conn.close()
        # Skip interpreter teardown: gloo threads or a peer's half-finished collective must not
        # keep this process alive.
        os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args,
    timeout: float = 180.0,
    collective_timeout: float = 60.0,
    init_process_group: bool = True,
    env: dict[str, str] | None = None,
    start_method: str | None = None,
    **kwargs,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the results in rank order.

    ``timeout`` bounds the whole run; ``collective_timeout`` bounds each collective inside it.
    With ``init_process_group=False`` the ranks get the launcher environment but no process group
    (to test code that initialises its own). ``start_method`` defaults to ``fork`` (ranks start in
    milliseconds; set ``BIGDENSE_START_METHOD=spawn`` to use fresh interpreters).
    """
    method = start_method or os.environ.get("BIGDENSE_START_METHOD", "fork")
    launch = (fn, world_size, args, kwargs, timeout, collective_timeout, init_process_group, dict(env or {}), method)
    results, failures, pending = _run_once(*launch)
    if failures and any(status == "init_error" for status, _ in failures.values()):
        # gloo's full-mesh connect can fail on a loaded machine before any test code ran; that
        # says nothing about the code under test, so the run is repeated once from scratch.
        results, failures, pending = _run_once(*launch)
    if failures:
        first = next(iter(failures))
        lines = "\n".join(
            f"  rank {r}: {_last_line(payload)}" for r, (_, payload) in failures.items() if r != first
        )
        also = f"; the others:\n{lines}" if lines else ""
        raise RankError(f"rank {first} of {world_size} failed first{also}\n{failures[first][1]}")
    if pending:
        raise RankError(
            f"ranks {sorted(pending.values())} of {world_size} did not finish within {timeout:.0f}s and were killed"
        )
    return results


def _last_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _run_once(fn, world_size, args, kwargs, timeout, collective_timeout, init_process_group, env, method):
    """One launch: (results, {rank: (status, payload)} in order of failure, {conn: rank} unfinished)."""
    ctx = mp.get_context(method)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    gate = ctx.Event()
    procs, pending = [], {}
    results: list[Any] = [None] * world_size
    failures: dict[int, tuple[str, str]] = {}
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, world_size, store.port, fn, args, kwargs, child_end,
                      init_process_group, collective_timeout, env, gate),
                daemon=True,
            )
            proc.start()
            child_end.close()
            procs.append(proc)
            pending[parent_end] = rank
        gate.set()
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            reports = []
            for conn in wait(list(pending), timeout=remaining):
                rank = pending.pop(conn)
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except EOFError:
                    procs[rank].join(1.0)
                    status, payload = "died", f"rank {rank} died without reporting (exit code {procs[rank].exitcode})"
                reports.append((rank, status, payload))
            # Several reports in one wake-up: a rank that died is the cause, its peers' errors
            # ("connection reset by peer") the echo.
            for rank, status, payload in sorted(reports, key=lambda r: r[1] != "died"):
                if status == "ok":
                    results[rank] = payload
                else:
                    failures[rank] = (status, payload)
            if failures:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(5.0)
        del store
    return results, failures, pending
