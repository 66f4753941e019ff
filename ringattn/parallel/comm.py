"""Ring point-to-point communication behind one small class.

Every rank sends to the next rank of the group and receives from the previous one, in
group-rank order, with batched isend/irecv. Peers are addressed by global rank, so any
process group (a subgroup, one dimension of a DeviceMesh) works.
"""

import torch
import torch.distributed as dist


class RingComm:
    """Queue send/recv pairs, `commit` them as one batch, `wait` for all of them.

    Usage per ring step: ``nxt = comm.send_recv(cur); comm.commit(); ...compute...; comm.wait()``.
    The tensors handed to send_recv must stay alive and unmodified until wait() returns.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.send_peer = dist.get_global_rank(self.group, (self.rank + 1) % self.world_size)
        self.recv_peer = dist.get_global_rank(self.group, (self.rank - 1) % self.world_size)
        self._ops: list[dist.P2POp] = []
        self._reqs: list = []

    def send_recv(self, to_send: torch.Tensor, recv_buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Queue sending `to_send` to the next rank and receiving its twin from the previous one.

        Returns the receive buffer (filled once wait() returns).
        """
        to_send = to_send.contiguous()
        if recv_buffer is None:
            recv_buffer = torch.empty_like(to_send)
        self._ops.append(dist.P2POp(dist.isend, to_send, self.send_peer, self.group))
        self._ops.append(dist.P2POp(dist.irecv, recv_buffer, self.recv_peer, self.group))
        return recv_buffer

    def commit(self) -> None:
        """Start every queued operation."""
        if self._reqs:
            raise RuntimeError("RingComm.commit called again before wait()")
        self._reqs = dist.batch_isend_irecv(self._ops)
        self._ops = []

    def wait(self) -> None:
        """Block (the host on gloo, the current stream on NCCL) until the committed batch is done."""
        for req in self._reqs:
            req.wait()
        self._reqs = []
