"""What travels the ring: only K/V at their own head count (GQA/MQA heads are never repeated),
and exactly the expected number of P2P tensors per forward and backward."""

import torch

from ringattn.ops import REFERENCE_OPS
from ringattn.parallel import RingComm, ring_attn_backward, ring_attn_forward
from tests.distributed import run_ranks
from tests.utils import make_qkv


class ByteCountingComm(RingComm):
    """RingComm that records the bytes and the number of tensors it sends."""

    def __init__(self, group=None):
        super().__init__(group)
        self.sent_bytes = 0
        self.sent_tensors = 0
        self.shifts = []  # per tensor sent: how many ranks on its peer is

    def send_recv(self, to_send, recv_buffer=None, shift=1):
        self.sent_bytes += to_send.numel() * to_send.element_size()
        self.sent_tensors += 1
        self.shifts.append(shift % self.world_size)
        return super().send_recv(to_send, recv_buffer, shift)


def _bytes_per_pass(rank, world_size, heads_k, dtype=torch.float32):
    """(forward bytes, forward tensors, backward bytes, backward tensors) for Hq = 8, S_local = 16, D = 16."""
    q, k, v, dout = make_qkv(1, 16, 16, 8, heads_k, 16, dtype, "cpu", seed=rank)
    comm = ByteCountingComm()
    out, lse = ring_attn_forward(comm, REFERENCE_OPS, q, k, v, 0.25, True, "zigzag")
    fwd = (comm.sent_bytes, comm.sent_tensors)
    ring_attn_backward(comm, REFERENCE_OPS, dout, q, k, v, out, lse, 0.25, True, "zigzag")
    return fwd + (comm.sent_bytes - fwd[0], comm.sent_tensors - fwd[1])


def _volumes(rank, world_size):
    return {heads_k: _bytes_per_pass(rank, world_size, heads_k) for heads_k in (8, 2, 1)}


def _bf16_volumes(rank, world_size):
    return _bytes_per_pass(rank, world_size, 2, torch.bfloat16)


def test_bytes_sent_are_proportional_to_kv_heads():
    world_size = 3
    for volumes in run_ranks(_volumes, world_size):
        kv_block = 16 * 16 * 4  # S_local x D x fp32 bytes, per kv head
        for heads_k, (fwd_bytes, fwd_tensors, bwd_bytes, bwd_tensors) in volumes.items():
            # forward: K and V for W - 1 hops; backward: K and V for W - 1 hops, fp32 dK and dV for W hops
            assert fwd_tensors == 2 * (world_size - 1) and bwd_tensors == 2 * (world_size - 1) + 2 * world_size
            assert fwd_bytes == 2 * (world_size - 1) * heads_k * kv_block
            assert bwd_bytes == (2 * (world_size - 1) + 2 * world_size) * heads_k * kv_block
        assert volumes[8][0] == 8 * volumes[1][0] and volumes[2][2] == 2 * volumes[1][2]


def test_last_dkdv_hop_carries_the_input_dtype():
    """bf16 inputs: K/V travel in bf16, the dK/dV accumulators in fp32, except on their last hop, which carries
    the complete sums already rounded to bf16 (the rounding the caller would do after it)."""
    world_size, heads_k, kv_block = 3, 2, 16 * 16  # S_local x D elements per kv head
    for fwd_bytes, fwd_tensors, bwd_bytes, bwd_tensors in run_ranks(_bf16_volumes, world_size):
        assert fwd_bytes == 2 * (world_size - 1) * heads_k * kv_block * 2 and fwd_tensors == 2 * (world_size - 1)
        kv_hops = 2 * (world_size - 1) * heads_k * kv_block * 2
        accumulator_hops = 2 * (world_size - 1) * heads_k * kv_block * 4 + 2 * heads_k * kv_block * 2
        assert bwd_bytes == kv_hops + accumulator_hops and bwd_tensors == 2 * (world_size - 1) + 2 * world_size


def _window_forward_tensors(rank, world_size, window):
    q, k, v, _ = make_qkv(1, 16, 16, 2, 2, 16, torch.float32, "cpu", seed=rank)
    comm = ByteCountingComm()
    ring_attn_forward(comm, REFERENCE_OPS, q, k, v, 0.25, True, "contiguous", window=window)
    return comm.sent_tensors


def _window_backward_sends(rank, world_size, window):
    """The shift of each tensor the backward sends (its gradients: test_ring.py's window tests)."""
    q, k, v, dout = make_qkv(1, 16, 16, 2, 2, 16, torch.float32, "cpu", seed=rank)
    out, lse = ring_attn_forward(RingComm(), REFERENCE_OPS, q, k, v, 0.25, True, "contiguous", window=window)
    comm = ByteCountingComm()
    ring_attn_backward(comm, REFERENCE_OPS, dout, q, k, v, out, lse, 0.25, True, "contiguous", window=window)
    return comm.shifts


def test_window_forward_stops_after_the_last_block_any_rank_needs():
    """A causal window of 10 tokens over shards of 16: every rank needs its own block and its predecessor's
    (steps 0 and 1), so K and V make one hop instead of W - 1; of 20 tokens, two blocks back, two hops; with no
    window, W - 1 hops."""
    world_size = 4
    assert run_ranks(_window_forward_tensors, world_size, (10, None)) == [2] * world_size
    assert run_ranks(_window_forward_tensors, world_size, (20, None)) == [4] * world_size
    assert run_ranks(_window_forward_tensors, world_size, (None, None)) == [2 * (world_size - 1)] * world_size


def test_window_backward_sends_each_block_home_from_its_last_step():
    """W = 4, shards of 16. A causal window of 10 tokens: K/V make one hop (step 0 -> 1), the dK/dV accumulators
    one hop on (step 0 -> 1) and one straight back home (shift -1: W - 1 places on); of 20 tokens, two hops of
    K/V, accumulators two on and one back over two (shift -2: 2 places on); of 0, a rank's own block only:
    nothing travels. Without a window: W - 1 hops of K/V, W of the accumulators, every one to the next rank."""
    world_size = 4
    assert run_ranks(_window_backward_sends, world_size, (10, None)) == [[1, 1, 1, 1, 3, 3]] * world_size
    assert run_ranks(_window_backward_sends, world_size, (20, None)) == [[1] * 8 + [2, 2]] * world_size
    assert run_ranks(_window_backward_sends, world_size, (0, None)) == [[]] * world_size
    assert run_ranks(_window_backward_sends, world_size, (None, None)) == [[1] * 14] * world_size
