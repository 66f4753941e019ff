"""Ring point-to-point communication behind one small class.

Every rank sends to the next rank of the group and receives from the previous one, in
group-rank order, with batched isend/irecv. Peers are addressed by global rank, so any
process group (a subgroup, one dimension of a DeviceMesh) works.

A peer that dies or never arrives must give an error, not a hang (docs/design.md, section 7):
on CPU tensors (gloo) `wait` waits at most `timeout_s` and raises a RuntimeError naming the
peers and the step. On CUDA tensors (NCCL) a timed wait would block the host at every step,
so `wait` only orders the streams and the process group's own timeout and watchdog apply.
A failed exchange leaves its group unusable on that rank (mark_unusable): a later one would pair with what the
peers still have pending, so every later call on the group raises at once (check_usable).
"""

import os
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from .groups import or_world

P2P_TIMEOUT_ENV = "RINGATTN_P2P_TIMEOUT_S"
GROUP_TIMEOUT_ENV = "RINGATTN_TIMEOUT"  # ringattn.distributed's process-group timeout, the fallback
DEFAULT_P2P_TIMEOUT_S = 300.0
# gloo counts a timeout in milliseconds, and torch passes it on in int64 nanoseconds: under 1 ms it is 0 (at once),
# past 9.2e9 s it overflows (every wait fails at once)
TIMEOUT_RANGE_S = (0.001, 1e9)


def p2p_timeout_s(
    timeout_s: float | None = None, variables: tuple[str, ...] = (P2P_TIMEOUT_ENV, GROUP_TIMEOUT_ENV)
) -> float:
    """Seconds a rank waits for its ring peers on gloo: `timeout_s`, else $RINGATTN_P2P_TIMEOUT_S, else
    $RINGATTN_TIMEOUT (the process-group timeout of ringattn.distributed.init_distributed), else 300.
    `variables`: the environment variables read, in turn (init_distributed reads $RINGATTN_TIMEOUT alone).

    Raises:
        ValueError: a value (argument or environment) that is not a number of seconds in TIMEOUT_RANGE_S.
        TypeError: a `timeout_s` that is not a number.
    """
    source = "timeout_s"
    if timeout_s is None:
        name = next((n for n in variables if os.environ.get(n, "").strip()), None)
        if name is None:
            return DEFAULT_P2P_TIMEOUT_S
        raw, source = os.environ[name], f"${name}"
        try:
            timeout_s = float(raw)
        except ValueError:
            low, high = TIMEOUT_RANGE_S
            raise ValueError(f"{source} must be a number of seconds from {low:g} to {high:g}, got {raw!r}") from None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
        raise TypeError(f"{source} must be a number of seconds, got {type(timeout_s).__name__}")
    low, high = TIMEOUT_RANGE_S
    if not low <= timeout_s <= high:
        raise ValueError(f"{source} must be a number of seconds from {low:g} to {high:g}, got {timeout_s}")
    return float(timeout_s)


class CommunicationError(RuntimeError):
    """An exchange of a group failed or did not finish in time (wait_all, RingComm.commit). What the group's peers
    have pending is then unknown, so no further exchange on it may follow: it could pair with a pending one of
    another size, which gloo answers by aborting the process."""


# the groups an earlier call left unusable on this rank, with why (weak keys: a group made anew starts clean)
_unusable: "weakref.WeakKeyDictionary[dist.ProcessGroup, str]" = weakref.WeakKeyDictionary()


def mark_unusable(group: dist.ProcessGroup | None, why: str) -> None:
    """Record that no further exchange may use `group` (None: the world) on this rank, and `why` (the first reason
    is kept): what its peers have pending is unknown, or its ranks are out of step (check_usable raises)."""
    _unusable.setdefault(or_world(group), why)


def check_usable(group: dist.ProcessGroup | None, what: str) -> None:
    """Raise CommunicationError naming `what` when an earlier call left `group` unusable on this rank (mark_unusable),
    before any exchange on it: one would pair with a peer's pending or other call, which gloo may answer by
    aborting the process, or return another call's data."""
    why = _unusable.get(or_world(group))
    if why is not None:
        raise CommunicationError(
            f"{what}: the group cannot be used again on this rank: {why}. Exit, or destroy the group and create a "
            "new one on every rank."
        )


def wait_all(
    works: list, timeout_s: float, what: str, peers: list[str] | None = None, group: dist.ProcessGroup | None = None
) -> None:
    """Wait for `works` (the Work objects of a gloo batch or collective on `group`), all within one deadline of
    `timeout_s`; a failure leaves `group` unusable on this rank (mark_unusable).

    Raises:
        CommunicationError: one of them failed (e.g. a peer's connection closed) or did not finish in time;
            the message says `what` was waited for and, when given, the peer of the failing work.
    """
    deadline = time.monotonic() + timeout_s
    for i, work in enumerate(works):
        remaining = max(deadline - time.monotonic(), 0.001)
        try:
            work.wait(timedelta(seconds=remaining))
        except Exception as err:  # noqa: BLE001 - gloo raises RuntimeError or DistBackendError; re-raised below
            peer = f", {peers[i]}" if peers is not None and i < len(peers) else ""
            timed_out = time.monotonic() >= deadline - 0.05  # gloo's wait may return a few ms before it
            why = f"did not complete within {timeout_s:g} s" if timed_out else "failed"
            mark_unusable(group, f"{what} {why} at an earlier call")
            raise CommunicationError(
                f"{what}{peer}: {why}; a peer died, raised, or is not running the same ring call. "
                f"Raise the limit with ${P2P_TIMEOUT_ENV} if it is only slow. Backend error: {err}"
            ) from err


class RingComm:
    """Queue send/recv pairs, `commit` them as one batch, `wait` for all of them.

    Usage per ring step: ``nxt = comm.send_recv(cur); comm.commit("step 3"); ...compute...; comm.wait()``.
    The tensors handed to send_recv must stay unmodified until wait() returns (RingComm keeps them alive).

    Args:
        group: the ring's process group (default: the world).
        timeout_s: how long wait() waits on CPU (gloo) tensors before raising; default as p2p_timeout_s
            ($RINGATTN_P2P_TIMEOUT_S, else $RINGATTN_TIMEOUT, else 300 s). CUDA (NCCL) waits are governed by the
            process group's timeout instead (see the module docstring).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, timeout_s: float | None = None):
        self.group = or_world(group)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.send_peer = dist.get_global_rank(self.group, (self.rank + 1) % self.world_size)
        self.recv_peer = dist.get_global_rank(self.group, (self.rank - 1) % self.world_size)
        self.timeout_s = p2p_timeout_s(timeout_s)
        self._ops: list[dist.P2POp] = []
        self._reqs: list = []
        self._in_flight: list[dist.P2POp] = []
        self._peers: list[str] = []  # per committed op, for errors
        self._label = ""
        self._timed = True
        check_usable(self.group, self._what())

    def send_recv(self, to_send: torch.Tensor, recv_buffer: torch.Tensor | None = None, shift: int = 1) -> torch.Tensor:
        """Queue sending `to_send` to the next rank and receiving its twin from the previous one; with `shift`, to
        the rank `shift` places on and from the one `shift` places back (-t: a block's gradient going home from
        the rank that holds it t steps after its own).

        Returns the receive buffer (filled once wait() returns).
        """
        to_send = to_send.contiguous()
        if recv_buffer is None:
            recv_buffer = torch.empty_like(to_send)
        send_peer, recv_peer = self.send_peer, self.recv_peer
        if shift != 1:
            send_peer = dist.get_global_rank(self.group, (self.rank + shift) % self.world_size)
            recv_peer = dist.get_global_rank(self.group, (self.rank - shift) % self.world_size)
        self._ops.append(dist.P2POp(dist.isend, to_send, send_peer, self.group))
        self._ops.append(dist.P2POp(dist.irecv, recv_buffer, recv_peer, self.group))
        return recv_buffer

    def commit(self, label: str = "") -> None:
        """Start every queued operation; `label` (e.g. "forward step 2 (K/V)") names the batch in errors."""
        if self._reqs:
            raise RuntimeError("RingComm.commit called again before wait()")
        self._timed = all(op.tensor.device.type == "cpu" for op in self._ops)
        self._label = label
        self._peers = [self._describe(op) for op in self._ops]
        try:
            self._reqs = dist.batch_isend_irecv(self._ops)
        except Exception as err:  # noqa: BLE001 - gloo can refuse to post at once when a peer's connection is gone
            self._ops = []
            peers = ", ".join(sorted(set(self._peers)))
            mark_unusable(self.group, f"{self._what()} failed at an earlier call")
            raise CommunicationError(
                f"{self._what()}, {peers}: failed; a peer died, raised, or is not running the same ring call. "
                f"Backend error: {err}"
            ) from err
        self._in_flight, self._ops = self._ops, []  # keep the tensors alive until wait()

    def _describe(self, op: dist.P2POp) -> str:
        if op.op is dist.isend:
            return f"sending to global rank {op.peer}"
        return f"receiving from global rank {op.peer}"

    def wait(self) -> None:
        """Block until the committed batch is done: the host on gloo (at most timeout_s), the current stream on NCCL.

        Raises:
            RuntimeError (gloo): a peer's send or receive failed or did not complete within timeout_s;
                the message names this rank, the peer, and the batch's label.
        """
        reqs, self._reqs = self._reqs, []
        self._in_flight = []
        if not self._timed:
            for req in reqs:
                req.wait()
            return
        # gloo returns one Work per P2P op, in op order; otherwise name the whole batch
        peers = self._peers if len(reqs) == len(self._peers) else None
        wait_all(reqs, self.timeout_s, self._what(), peers, self.group)

    def _what(self) -> str:
        """This rank and the batch's label, for errors."""
        what = f"ring P2P of group rank {self.rank} (of {self.world_size})"
        return f"{what} at {self._label}" if self._label else what
