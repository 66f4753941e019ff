"""RingComm's failure behaviour: a peer that dies or never arrives gives a RuntimeError naming the
peer and the ring step within the timeout, never a hang (gloo, spawned ranks)."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from ringattn.ops import REFERENCE_OPS
from ringattn.parallel import RingComm, ring_attn_forward
from ringattn.parallel.comm import DEFAULT_P2P_TIMEOUT_S, GROUP_TIMEOUT_ENV, P2P_TIMEOUT_ENV, p2p_timeout_s
from tests.distributed import run_ranks

TIMEOUT_S = 1.5
DEAD_RANK, DEAD_EXIT_CODE = 2, 7


def test_timeout_comes_from_argument_then_environment_then_default(monkeypatch):
    monkeypatch.delenv(P2P_TIMEOUT_ENV, raising=False)
    monkeypatch.delenv(GROUP_TIMEOUT_ENV, raising=False)
    assert p2p_timeout_s() == DEFAULT_P2P_TIMEOUT_S == 300.0
    monkeypatch.setenv(GROUP_TIMEOUT_ENV, "40")
    assert p2p_timeout_s() == 40.0
    monkeypatch.setenv(P2P_TIMEOUT_ENV, "12.5")
    assert p2p_timeout_s() == 12.5
    assert p2p_timeout_s(2) == 2.0
    for bad in ("soon", "0", "-3", "inf", "1e10", "0.0001"):
        monkeypatch.setenv(P2P_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=P2P_TIMEOUT_ENV):
            p2p_timeout_s()
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds from 0.001 to 1e[+]09"):
        p2p_timeout_s(0.0)
    with pytest.raises(TypeError, match="timeout_s must be a number"):
        p2p_timeout_s("5")


class _DyingOps:
    """Reference block ops on which DEAD_RANK leaves the process at its first block: during ring step 0,
    after it has posted that step's sends and receives."""

    def __init__(self, rank):
        self.rank, self.calls = rank, 0
        self.bwd, self.bwd_preprocess = REFERENCE_OPS.bwd, REFERENCE_OPS.bwd_preprocess

    def _block(self, op, *args, **kwargs):
        self.calls += 1
        if self.rank == DEAD_RANK and self.calls == 1:
            os._exit(DEAD_EXIT_CODE)
        return op(*args, **kwargs)

    def fwd(self, *args, **kwargs):  # a ring of one
        return self._block(REFERENCE_OPS.fwd, *args, **kwargs)

    def fwd_merge_(self, *args, **kwargs):  # every step of a ring of more
        return self._block(REFERENCE_OPS.fwd_merge_, *args, **kwargs)


def _ring_with_a_failing_peer(rank, world_size, failure):
    # every rank past its group's setup first: a rank that died while a peer was still connecting failed that
    # peer inside init_process_group, not in the ring
    dist.barrier()
    q = torch.randn(1, 8, 2, 16)
    comm = RingComm(timeout_s=TIMEOUT_S)
    if failure == "never_arrives" and rank == DEAD_RANK:
        time.sleep(TIMEOUT_S + 1.5)  # alive, but never joins the ring; the others must give up first
        return None
    start = time.monotonic()
    try:
        ring_attn_forward(comm, _DyingOps(rank), q, q[:, :, :1], q[:, :, :1], 0.25, False)
    except RuntimeError as err:
        if failure == "dies":
            raise  # uncaught: the harness must report it
        return str(err), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_dead_peer_makes_the_others_raise_and_the_harness_report_it():
    """3 ranks; rank 2 exits in the middle of the ring (os._exit during step 0). The ranks left waiting for
    it raise a RuntimeError naming this rank, the peer and the step, uncaught, and run_ranks reports it
    at once (not at its own timeout)."""
    pattern = r"rank [01] failed:[\s\S]*CommunicationError: ring P2P of group rank [01] \(of 3\) at forward step [01] "
    pattern += r"\(K/V\), (receiving from|sending to) global rank \d[^:]*: failed; a peer died"
    start = time.monotonic()
    with pytest.raises(AssertionError, match=pattern):
        run_ranks(_ring_with_a_failing_peer, 3, "dies", timeout=60, expect_exit={DEAD_RANK: DEAD_EXIT_CODE})
    assert time.monotonic() - start < 40


def test_absent_peer_makes_the_others_raise_within_the_timeout():
    """3 ranks; rank 2 is alive but never calls the ring. Ranks 0 and 1 each raise a RuntimeError naming
    the peer and the step within the P2P timeout (per wait); rank 0, waiting for rank 2's block, can only
    be freed by the timeout."""
    results = run_ranks(_ring_with_a_failing_peer, 3, "never_arrives", timeout=60, barrier=False)
    for rank in (0, 1):
        message, elapsed = results[rank]
        assert elapsed < 2 * TIMEOUT_S + 1.0, f"rank {rank} took {elapsed:.1f} s"
        assert f"group rank {rank} (of 3) at forward step" in message and "global rank" in message, message
    assert f"receiving from global rank 2: did not complete within {TIMEOUT_S:g} s" in results[0][0], results[0][0]
    assert results[0][1] < TIMEOUT_S + 1.0
