"""The Hopper backend (compute capability 9.x): the kernels of kernels/sm90/, each where it was timed faster than
the portable one on the H200 (docs/performance.md), every other call on the portable backend (ops/portable.py).

What it takes, by kernel (TABLE: head dims and launch configs; the *_supported functions: the rest). All of them
take causal and not, MHA, GQA and MQA, and need every tensor 16-byte aligned for their TMA descriptors; the Gluon
forward and backward also take sliding windows and soft-capping, the split kernels neither (their calls run on the
portable kernels).
- fwd, the Gluon forward (a TMA producer warp, two consumer warpgroups): D = 96, 128 and 256 (256 in tiles of 64
  keys, which keep the consumers' registers and shared memory in bounds; at D = 64 it ran 0.97x to 1.03x the portable
  forward, with two or three consumers: docs/performance.md, decisions); fp16 or bf16, out in q's
  dtype or the ring's fp32 state (rows finished into the output too); no documents; a GPU (the interpreter cannot
  run Gluon).
- bwd, the Gluon backward (a TMA producer warp, a dQ writer warp, two consumer warpgroups): D = 64, 96, 128 and 256
  (at 256 the consumers split the columns, not the keys: 64 keys' dK and dV would take 256 registers a thread);
  fp16 or bf16; not deterministic (its dQ additions come in the programs' order); no documents; a GPU. It runs every
  backward the table takes; the split kernels below run the deterministic ones.
- dkdv, triton's warp specialisation over 128-key tiles: D = 64 and 128; fp16 or bf16 (the interpreter: any);
  no documents; dK, dV stored, not added; GQA's q and dout heads packed; Sq a multiple of 4.
- dq, triton's warp specialisation: D = 128 (slower than the portable kernel at D = 64); fp16 or bf16 (the
  interpreter: any); no documents, no final rows; Sq a multiple of 4.
Both Gluon kernels run D = 96 in 128-column tiles (padded_head_dim): TMA loads the columns past 96 as zeros and
stores none of them (the portable kernels pad it alike), and ran 1.3x to 1.4x the portable forward's speed and 1.5x
to 2.0x its forward+backward there (H100).
The split dK/dV and dQ kernels are Triton-language code, so the interpreter runs them too: the CPU tests ask for
this backend by name.
"""

from collections.abc import Callable

import torch
import triton

from ..kernels.sm90.attn_bwd import _attn_bwd_dkdv_ws_kernel, _attn_bwd_dq_ws_kernel
from .calls import BwdCall, FwdCall, Target, plain_scores
from .launch import (
    LOG2E,
    KernelLaunch,
    LaunchConfig,
    band_args,
    descriptor_aligned,
    final_args,
    padded_head_dim,
    strides,
)
from .portable import INTERPRETER_CONFIG

TABLE = {  # D = 96 runs 128-column tiles at D = 128's configs (not swept)
    # num_warps is the first consumer's warpgroup (the kernel adds the second and a producer warp), num_stages the
    # depth of its key and value rings (launch/tools/config_sweep.py timed 2 and 3 alike)
    "fwd": {96: LaunchConfig(128, 128, 4, 2), 128: LaunchConfig(128, 128, 4, 2), 256: LaunchConfig(128, 64, 4, 2)},
    # the Gluon backward: block_m query rows a step, block_n keys a program, num_warps the first consumer's
    # warpgroup, num_stages the depth of its Q and dO ring (at D = 64, 128 rows spill up to 148 bytes and ran 1.02x
    # to 1.07x 64 rows' speed; a ring of 3 ran within 2% at D = 128, 4% to 5% slower at D = 64 without a mask; at
    # D = 256 the consumers split the columns, and a second Q and dO slot would pass the shared memory)
    "bwd": {
        64: LaunchConfig(128, 128, 4, 2),
        96: LaunchConfig(64, 128, 4, 2),
        128: LaunchConfig(64, 128, 4, 2),
        256: LaunchConfig(64, 64, 4, 1),
    },
    # num_warps is the consumers' warpgroup: the partitioner adds a producer one and splits the consumers in two
    "dkdv": {64: LaunchConfig(64, 128, 4, 2), 128: LaunchConfig(64, 128, 4, 2)},
    "dq": {128: LaunchConfig(128, 64, 4, 2)},
}
# soft-capped calls where TABLE's config does not suit them: at D = 64, 128 rows a step keep tanh's t beside the
# scores and spill 716 to 956 bytes; 64 rows spill none and ran 1.7x to 2.4x faster (H100, S = 16k)
SOFTCAPPED = {"bwd": {64: LaunchConfig(64, 128, 4, 2)}}
# the Gluon kernels' registers per thread at launch: 12 warps x 32 x 168 fill the SM's 64K registers, which the
# kernels then move to 240 for each consumer and 24 for the producer (and the backward's dQ writer)
GLUON_MAXNREG = 168
SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def launch_config(kernel: str, head_dim: int, target: Target, softcapped: bool = False) -> LaunchConfig | None:
    """The config of the Hopper kernel `kernel` (a key of TABLE) at a head dim, soft-capped or not (SOFTCAPPED's
    where it has one), None where TABLE does not take it; the interpreter's for CPU runs of the split kernels."""
    config = TABLE[kernel].get(head_dim)
    if softcapped and config is not None:
        config = SOFTCAPPED.get(kernel, {}).get(head_dim, config)
    return config if config is None or target.gpu else INTERPRETER_CONFIG


def bwd_supported(call: BwdCall, target: Target) -> bool:
    """Whether the Gluon backward takes `call`: a GPU, fp16 or bf16, not deterministic (its dQ additions come in the
    programs' order; with them in a fixed order it ran 0.5 to 0.8x the split kernels, whose every gradient row has one
    writer), no documents, a head dim of TABLE, dQ either the call's own output (stored, no final rows: the kernel
    adds into an fp32 scratch, copied out after) or an fp32 accumulator (the ring's), and q, k, v, dout, dQ as its
    descriptors take them (descriptor_aligned; any head stride: Hugging Face's (B, H, S, D) tensors transposed too)."""
    q, dq = call.q, call.dq
    if not target.gpu or call.q_doc_ids is not None or q.dtype not in SIXTEEN_BIT or q.shape[-1] not in TABLE["bwd"]:
        return False
    if call.deterministic:
        return False
    if dq.dtype == torch.float32:
        if not descriptor_aligned(dq):
            return False
    elif call.add_dq or call.dq_final is not None:
        return False
    return all(descriptor_aligned(t) for t in (q, call.k, call.v, call.dout))


def _bwd_stats(call: BwdCall, block_m: int) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """The row stats as the Gluon backward loads them, (3, B, Hq, Sq') with Sq' the multiple of block_m at or above
    Sq and zeros past Sq: the call's own where they are so, else a copy of them (made by the returned function)."""
    stats = call.stats
    _, batch, heads_q, seqlen_q = stats.shape
    if seqlen_q % block_m == 0 and stats.is_contiguous() and stats.data_ptr() % 16 == 0:
        return stats, None
    padded = stats.new_zeros(3, batch, heads_q, triton.cdiv(seqlen_q, block_m) * block_m)

    def copy() -> None:
        padded[..., :seqlen_q].copy_(stats)

    return padded, copy


def _split_kernel_dtype(q: torch.Tensor, target: Target) -> bool:
    """The split kernels' dtypes: 16-bit on a GPU (fp32 would multiply in tf32 there), any in the interpreter."""
    return not target.gpu or q.dtype in SIXTEEN_BIT


def fwd_supported(call: FwdCall, target: Target) -> bool:
    """Whether the Gluon forward takes `call`: a GPU, fp16 or bf16 with out in q's dtype or fp32 (merging, or rows
    finished elsewhere: the ring's fp32 state), no documents, a head dim of TABLE, lse's last dim contiguous, q, k, v,
    out as its descriptors take them (descriptor_aligned)."""
    q, out = call.q, call.out
    if not target.gpu or call.q_doc_ids is not None or q.dtype not in SIXTEEN_BIT:
        return False
    fp32_state = call.merge_state or call.final is not None
    if out.dtype not in ((torch.float32,) if fp32_state else (q.dtype, torch.float32)):
        return False
    if q.shape[-1] not in TABLE["fwd"]:
        return False
    return call.lse.stride(-1) == 1 and all(descriptor_aligned(t) for t in (q, call.k, call.v, out))


def _split_supported(kernel: str, call: BwdCall, tensors: tuple[torch.Tensor, ...], target: Target) -> bool:
    """What both split kernels need: no documents, no window or soft-capping, a head dim of TABLE[kernel], their dtypes,
    Sq a multiple of 4
    (each head's row of stats 16-byte aligned), every tensor of the call aligned."""
    q = call.q
    if call.q_doc_ids is not None or not plain_scores(call) or q.shape[-1] not in TABLE[kernel] or q.shape[1] % 4:
        return False
    return _split_kernel_dtype(q, target) and all(descriptor_aligned(t) for t in tensors)


def dkdv_supported(call: BwdCall, target: Target) -> bool:
    """Whether the split dK/dV kernel takes `call`: dK and dV stored, not added (the ring's shares, or no
    accumulators), for GQA q's and dout's heads packed (head stride D: its descriptors need it), and what both split
    kernels need."""
    q, dout, k = call.q, call.dout, call.k
    heads_packed = q.stride(2) == q.shape[-1] and dout.stride(2) == dout.shape[-1]
    if call.add_dkdv or (q.shape[2] != k.shape[2] and not heads_packed):
        return False
    tensors = (q, k, call.v, dout, call.stats, call.dk, call.dv)
    return _split_supported("dkdv", call, tensors, target)


def dq_supported(call: BwdCall, target: Target) -> bool:
    """Whether the split dQ kernel takes `call`: no final rows (the ring's last step), and what both split kernels
    need."""
    tensors = (call.q, call.k, call.v, call.dout, call.stats, call.dq)
    return call.dq_final is None and _split_supported("dq", call, tensors, target)


def fwd_launch(call: FwdCall, cfg: LaunchConfig) -> KernelLaunch:
    """_attn_fwd_gluon_kernel writing (or, with merge_state, merging into) call.out and call.lse; fwd_supported."""
    from ..kernels.sm90.attn_fwd import _attn_fwd_gluon_kernel  # Gluon: imported once a call is taken
    from ..kernels.sm90.descriptors import head_tiles

    q, k, v, out, lse = call.q, call.k, call.v, call.out, call.lse
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    band, band_flags = band_args(call)
    final_out, *final_strides, final_lo, final_hi = final_args(call.final, out)
    block_d = padded_head_dim(head_dim)
    q_desc = head_tiles(q, cfg.block_m, block_d)
    # the fp32 state is stored by pointers: its descriptor is not read
    o_desc = q_desc if out.dtype == torch.float32 else head_tiles(out, cfg.block_m // 2, block_d)
    return KernelLaunch(
        "sm90.fwd",
        _attn_fwd_gluon_kernel,
        (triton.cdiv(seqlen_q, cfg.block_m), heads_q, batch),
        (
            q_desc, head_tiles(k, cfg.block_n, block_d), head_tiles(v, cfg.block_n, block_d), o_desc, out, lse,
            final_out, *strides(out), lse.stride(0), lse.stride(1), *final_strides, seqlen_q, seqlen_k, *band,
            final_lo, final_hi,
        ),
        dict(
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            GROUP_SIZE=heads_q // heads_k, **band_flags, MERGE_STATE=call.merge_state,
            OUT_FP32=out.dtype == torch.float32, HAS_FINAL_ROWS=call.final is not None,
            NUM_BUFFERS=cfg.num_stages, num_warps=cfg.num_warps, maxnreg=GLUON_MAXNREG,
            enable_fp_fusion=True,  # exp2(s * qk_scale - m) as one FMA, as the portable kernels
        ),
    )  # fmt: skip


# the most fp32 dQ scratch one Gluon backward launch holds where dQ is in q's dtype: a longer call runs over groups of
# kv heads in turn, each through the scratch of its q heads (S = 131072, H = 32, D = 128: 4 launches, 512 MiB
# instead of 2 GiB); the scratch is B x Sq x Hq x D x 4 bytes at most this, or one kv head's where that is more
DQ_SCRATCH_BYTES = 512 << 20


def scratch_kv_heads(batch: int, seqlen_q: int, heads_k: int, group_size: int, head_dim: int) -> int:
    """The kv heads of one Gluon backward launch whose dQ goes through the fp32 scratch: as many as keep the scratch
    of their q heads, (B, Sq, heads x group_size, D) fp32, within DQ_SCRATCH_BYTES, at least one, spread evenly over
    the launches."""
    per_kv_head = batch * seqlen_q * group_size * head_dim * 4
    launches = triton.cdiv(heads_k, max(1, min(heads_k, DQ_SCRATCH_BYTES // per_kv_head)))
    return triton.cdiv(heads_k, launches)


def _kv_heads(call: BwdCall, stats: torch.Tensor, first: int, end: int) -> tuple[BwdCall, torch.Tensor]:
    """call and its row stats narrowed to kv heads [first, end) and their q heads (views: dK, dV are written
    through them)."""
    group = call.q.shape[2] // call.k.shape[2]
    hq, hk = slice(first * group, end * group), slice(first, end)
    narrowed = call._replace(
        q=call.q[:, :, hq], dout=call.dout[:, :, hq], k=call.k[:, :, hk], v=call.v[:, :, hk], dk=call.dk[:, :, hk],
        dv=call.dv[:, :, hk], dq=call.dq[:, :, hq],
    )  # fmt: skip
    return narrowed, stats[:, :, hq]


def bwd_launches(call: BwdCall, cfg: LaunchConfig) -> tuple[KernelLaunch, ...]:
    """_attn_bwd_gluon_kernel's launches, to run in order: dK, dV stored into (add_dkdv: added into) call.dk,
    call.dv, and dQ added into call.dq (fp32, zeroed first unless add_dq; dq_final's rows copied out after: one
    launch), or, for a dQ in q's dtype, into an fp32 scratch copied into it after, a launch for each group of kv
    heads (scratch_kv_heads); bwd_supported."""
    stats, copy_stats = _bwd_stats(call, cfg.block_m)
    if call.dq.dtype == torch.float32:
        dq, final = call.dq, call.dq_final

        def prepare() -> None:
            if copy_stats is not None:
                copy_stats()
            if not call.add_dq:
                dq.zero_()

        def finish() -> None:
            if final is not None and len(final.rows):
                final.out[:, final.rows.start : final.rows.stop].copy_(dq[:, final.rows.start : final.rows.stop])

        return (_bwd_launch(call, stats, dq, cfg, prepare, finish),)
    batch, seqlen_q, heads_q, head_dim = call.q.shape
    heads_k = call.k.shape[2]
    per_launch = scratch_kv_heads(batch, seqlen_q, heads_k, heads_q // heads_k, head_dim)
    scratch = torch.empty((batch, seqlen_q, per_launch * heads_q // heads_k, head_dim), dtype=torch.float32,
                          device=call.q.device)  # fmt: skip
    launches = []
    for first in range(0, heads_k, per_launch):
        part, part_stats = _kv_heads(call, stats, first, min(first + per_launch, heads_k))
        dq = scratch[:, :, : part.q.shape[2]]

        def prepare(dq=dq, copy_stats=copy_stats if first == 0 else None) -> None:
            if copy_stats is not None:
                copy_stats()
            dq.zero_()

        def finish(dq=dq, out=part.dq) -> None:
            out.copy_(dq)

        launches.append(_bwd_launch(part, part_stats, dq, cfg, prepare, finish))
    return tuple(launches)


def _bwd_launch(
    call: BwdCall, stats: torch.Tensor, dq: torch.Tensor, cfg: LaunchConfig, prepare: Callable[[], None],
    finish: Callable[[], None],
) -> KernelLaunch:  # fmt: skip
    """_attn_bwd_gluon_kernel over call's heads, dQ added into dq (fp32), between prepare() and
    finish()."""
    from ..kernels.sm90.attn_bwd_gluon import _attn_bwd_gluon_kernel  # Gluon: imported once a call is taken
    from ..kernels.sm90.descriptors import head_tiles, row_tiles

    q, k, v, dout, dk, dv = call.q, call.k, call.v, call.dout, call.dk, call.dv
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    band, band_flags = band_args(call)
    block_d = padded_head_dim(head_dim)
    # each consumer's share of a step's dQ: all its rows and half its columns, or (128 rows a step) half its rows
    dq_rows, dq_cols = (cfg.block_m // 2, block_d) if cfg.block_m >= 128 else (cfg.block_m, block_d // 2)
    return KernelLaunch(
        "sm90.bwd",
        _attn_bwd_gluon_kernel,
        (triton.cdiv(seqlen_k, cfg.block_n), heads_k, batch),
        (
            head_tiles(q, cfg.block_m, block_d), head_tiles(k, cfg.block_n, block_d),
            head_tiles(v, cfg.block_n, block_d), head_tiles(dout, cfg.block_m, block_d),
            head_tiles(dq, dq_rows, dq_cols), row_tiles(stats[0], cfg.block_m),
            row_tiles(stats[2], cfg.block_m), dk, dv, *strides(dk), *strides(dv), seqlen_q, seqlen_k, *band,
            call.softmax_scale,
        ),
        dict(
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            GROUP_SIZE=heads_q // heads_k, **band_flags, ADD_DKDV=call.add_dkdv, NUM_BUFFERS=cfg.num_stages,
            SPLIT_COLS=block_d > 128, num_warps=cfg.num_warps, maxnreg=GLUON_MAXNREG, enable_fp_fusion=True,
        ),
        prepare=prepare,
        finish=finish,
    )  # fmt: skip


def mask_positions(call: BwdCall) -> torch.Tensor:
    """Row and key positions 0, 1, ..., max(Sq, Sk) - 1 (int32) that the split kernels' causal masks load (their
    module docstring says why they are loaded); the row stats (never read) when not causal."""
    if not call.causal:
        return call.stats
    return torch.arange(max(call.q.shape[1], call.k.shape[1]), dtype=torch.int32, device=call.q.device)


def dkdv_launch(call: BwdCall, cfg: LaunchConfig, positions: torch.Tensor) -> KernelLaunch:
    """_attn_bwd_dkdv_ws_kernel storing dK, dV into call.dk, call.dv; dkdv_supported, mask_positions(call)."""
    q, k, v, dout, dk, dv = call.q, call.k, call.v, call.dout, call.dk, call.dv
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    return KernelLaunch(
        "sm90.dkdv",
        _attn_bwd_dkdv_ws_kernel,
        (triton.cdiv(seqlen_k, cfg.block_n), heads_k, batch),
        (
            q, k, v, dout, call.stats, dk, dv, positions,
            *strides(q), *strides(k), *strides(v), *strides(dout), *strides(dk), *strides(dv),
            seqlen_q, seqlen_k, heads_k, call.stats.stride(0), call.softmax_scale * LOG2E, call.softmax_scale,
        ),
        dict(
            HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_SIZE=heads_q // heads_k,
            CAUSAL=call.causal, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            enable_fp_fusion=True,
        ),
        scratch=True,
    )  # fmt: skip


def dq_launch(call: BwdCall, cfg: LaunchConfig, positions: torch.Tensor) -> KernelLaunch:
    """_attn_bwd_dq_ws_kernel adding dQ into call.dq if call.add_dq, else storing it; dq_supported,
    mask_positions(call)."""
    q, k, v, dout, dq = call.q, call.k, call.v, call.dout, call.dq
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    return KernelLaunch(
        "sm90.dq",
        _attn_bwd_dq_ws_kernel,
        (triton.cdiv(seqlen_q, cfg.block_m), heads_q, batch),
        (
            q, k, v, dout, call.stats, dq, positions,
            *strides(q), *strides(k), *strides(v), *strides(dout), *strides(dq),
            seqlen_q, seqlen_k, heads_q, call.stats.stride(0), call.softmax_scale * LOG2E, call.softmax_scale,
        ),
        dict(
            HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_SIZE=heads_q // heads_k,
            CAUSAL=call.causal, ACCUMULATE=call.add_dq, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            enable_fp_fusion=True,
        ),
        scratch=True,
    )  # fmt: skip
