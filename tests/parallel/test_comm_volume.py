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
        self.sends = []  # per tensor sent: (how many ranks on its peer is, its rows, its dtype)

    def send_recv(self, to_send, recv_buffer=None, shift=1):
        self.sent_bytes += to_send.numel() * to_send.element_size()
        self.sent_tensors += 1
        self.sends.append((shift % self.world_size, to_send.shape[1], to_send.dtype))
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


def _window_sends(rank, world_size, layout, window):
    """(peer's distance on, rows) of each tensor the forward sends, and of each the backward sends (the gradients:
    test_ring.py's window tests); shards of 16, bf16."""
    q, k, v, dout = make_qkv(1, 16, 16, 2, 2, 16, torch.bfloat16, "cpu", seed=rank)
    comm = ByteCountingComm()
    out, lse = ring_attn_forward(comm, REFERENCE_OPS, q, k, v, 0.25, True, layout, window=window)
    forward, comm.sends = comm.sends, []
    ring_attn_backward(comm, REFERENCE_OPS, dout, q, k, v, out, lse, 0.25, True, layout, window=window)
    return forward, comm.sends


def test_window_forward_sends_only_the_rows_the_windows_read():
    """W = 4, shards of 16, causal. Contiguous, a window of 10 keys: each rank reads the last 10 rows of its
    predecessor's block, so K and V make one hop, 10 rows each, instead of W - 1 hops of 16; of 20 keys: the
    predecessor's whole block one hop on, and the last 4 rows of the block two back the other way round (two hops
    back, as short at W = 4, moving 4 rows instead of 16). Zigzag (chunks of 8), a window of 3: the end of the
    predecessor's first chunk one hop on, the end of the successor's second chunk one hop back. No window: W - 1
    hops of the whole block."""
    world_size, f = 4, torch.bfloat16
    for layout, window, want in [
        ("contiguous", (10, None), [(1, 10, f)] * 2),
        ("contiguous", (20, None), [(1, 16, f)] * 2 + [(3, 4, f)] * 4),
        ("zigzag", (3, None), [(1, 3, f)] * 2 + [(3, 3, f)] * 2),
        ("zigzag", (None, None), [(1, 16, f)] * 2 * (world_size - 1)),
    ]:
        for forward, _ in run_ranks(_window_sends, world_size, layout, window):
            assert forward == want, (layout, window)


def test_window_backward_sends_each_block_home_from_its_last_step():
    """W = 4, shards of 16, causal, bf16. Contiguous, a window of 10: K/V make one hop (10 rows), the dK/dV
    accumulators one hop on and, complete there and rounded to bf16, one straight back home (W - 1 places on).
    Zigzag, a window of 3: the same both ways at once, 3 rows each. Contiguous, a window of 20: rows 12 to 16 of
    each block travel both ways, so neither stream's accumulators are complete before they are home: the forward
    stream's (from the block's own share) and the backward one's (from zero, at its first holder) go home in fp32
    and are summed there. A window of 0: a rank's own block only, nothing travels. Without a window: W - 1 hops of
    K/V, W of the accumulators (the last rounded), every one to the next rank. Each batch in the order sent."""
    world_size, f, h = 4, torch.float32, torch.bfloat16
    for layout, window, want in [
        ("contiguous", (10, None), [(1, 10, h)] * 2 + [(1, 10, f)] * 2 + [(3, 10, h)] * 2),
        ("zigzag", (3, None), [(1, 3, h)] * 2 + [(3, 3, h)] * 2 + [(1, 3, f)] * 2 + [(3, 3, f)] * 2
         + [(3, 3, h)] * 2 + [(1, 3, h)] * 2),
        ("contiguous", (20, None), [(1, 16, h)] * 2 + [(3, 4, h)] * 2 + [(1, 16, f)] * 2 + [(3, 4, h)] * 2
         + [(3, 16, f)] * 2 + [(3, 4, f)] * 2 + [(2, 4, f)] * 2),
        ("contiguous", (0, None), []),
        ("zigzag", (None, None), [(1, 16, h)] * 2 + ([(1, 16, f)] * 2 + [(1, 16, h)] * 2) * 2 + [(1, 16, f)] * 2
         + [(1, 16, h)] * 2),
    ]:  # fmt: skip
        for _, backward in run_ranks(_window_sends, world_size, layout, window):
            assert backward == want, (layout, window)
