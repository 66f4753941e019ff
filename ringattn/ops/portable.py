"""The portable backend: the Triton kernels of kernels/portable/ on any CUDA GPU and in Triton's interpreter.

It runs every call the launchers accept (documents, rows finished into another buffer, any head dim up to 256,
fp16, bf16 and fp32), and every call the Hopper backend's table does not take (ops/sm90.py). Its table is one
launch config per kernel, padded head dim and dtype; on Hopper and newer GPUs the forward loads K/V tiles by TMA
where the tensors allow it (1.08 to 1.14x at D = 128, 1.00 to 1.05x at D = 64 on the H200: docs/performance.md).
"""

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..kernels.portable.attn_bwd import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_bwd_preprocess_kernel
from ..kernels.portable.attn_fwd import _attn_fwd_kernel
from .calls import BwdCall, FwdCall, Target
from .launch import KernelLaunch, LaunchConfig, band_args, descriptor_aligned, final_args, padded_head_dim, strides

INTERPRETER_CONFIG = LaunchConfig(32, 32, 4, 1)  # numpy does the work: few large tiles
# Per kernel, (largest padded head dim, config) pairs; the first that fits wins. The 16-bit configs up to D = 128
# come from launch/tools/config_sweep.py on the H200 (docs/performance.md, "Launch configs"). For dK/dV, block_n
# keys belong to one program and block_m query rows are a loop step; for dQ the other way round.
CONFIGS_16BIT = {
    "fwd": ((64, LaunchConfig(128, 64, 4, 3)), (128, LaunchConfig(128, 128, 8, 3)), (256, LaunchConfig(64, 32, 4, 2))),
    "dkdv": ((64, LaunchConfig(64, 64, 4, 3)), (128, LaunchConfig(64, 64, 4, 2)), (256, LaunchConfig(64, 64, 8, 1))),
    "dq": ((128, LaunchConfig(128, 64, 8, 3)), (256, LaunchConfig(64, 32, 4, 1))),
}
# fp32 at D = 256 in narrow tiles: at 32 x 32 ptxas left most forms for sm_90 at 32 registers a thread and 33 to 77
# KB of spills; these take 0.10x to 0.67x its time on an H100 (docs/performance.md, decisions), spill nothing on
# sm_80, sm_86 and (triton 3.6) sm_90, and fit blocks of 99 KiB (80, 98 and 96 KiB)
CONFIGS_FP32 = {
    "fwd": ((128, LaunchConfig(64, 32, 4, 2)), (256, LaunchConfig(16, 32, 4, 1))),
    "dkdv": ((128, LaunchConfig(32, 32, 4, 1)), (256, LaunchConfig(16, 32, 4, 1))),
    "dq": ((128, LaunchConfig(32, 32, 4, 1)), (256, LaunchConfig(32, 16, 4, 1))),
}
# GPUs whose blocks may have at most 99 KiB of shared memory (compute capability 8.6, 8.9 and 12.x: RTX 30, 40 and 50,
# A10, L4, L40): where a 16-bit config above needs more there (launch/tools/kernel_resources.py --arch 86: the forward
# and dQ at D = 128, 160 and 128 KiB, dK/dV at D = 256, 136 KiB), these, which fit (88, 80 and 66 KiB; not timed)
SMALL_SMEM_16BIT = {
    "fwd": {128: LaunchConfig(64, 64, 4, 3)},
    "dkdv": {256: LaunchConfig(32, 32, 4, 1)},
    "dq": {128: LaunchConfig(128, 32, 8, 2)},
}
PREPROCESS_BLOCK_M = 64


def launch_config(kernel: str, head_dim: int, dtype: torch.dtype, target: Target) -> LaunchConfig:
    """The config of the portable kernel `kernel` ("fwd", "dkdv" or "dq") for a head dim, dtype and target."""
    if not target.gpu:
        return INTERPRETER_CONFIG
    fp32 = dtype == torch.float32
    table = (CONFIGS_FP32 if fp32 else CONFIGS_16BIT)[kernel]
    block_d = padded_head_dim(head_dim)
    max_block_d, config = next((max_block_d, config) for max_block_d, config in table if block_d <= max_block_d)
    if not fp32 and _small_shared_memory(target):
        config = SMALL_SMEM_16BIT[kernel].get(max_block_d, config)
    return config


def _small_shared_memory(target: Target) -> bool:
    """Whether the target GPU's blocks may have at most 99 KiB of shared memory (SMALL_SMEM_16BIT)."""
    major, minor = target.capability
    return major == 12 or (major, minor) in ((8, 6), (8, 9))


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full fp32 ("ieee"), never tf32: exactness over speed for fp32.
    (fp16/bf16 dots ignore the setting.)"""
    return "ieee" if dtype == torch.float32 else "tf32"


def _approx_tanh(dtype: torch.dtype, target: Target) -> bool:
    """The kernels' APPROX_TANH: soft-capping's tanh by the GPU's tanh.approx for 16-bit inputs on a GPU (its error
    under their rounding, as the Hopper kernels'); fp32 inputs, and the interpreter (no inline PTX), take it to
    about one ulp."""
    return target.gpu and dtype != torch.float32


def _kv_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int, target: Target):
    """TMA descriptors of k and v (B, Sk, Hkv, D) with block (1, block_n, 1, D), or None where TMA cannot load
    them (pointer loads then): a GPU older than Hopper, D not a power of two of at least 16 (it would be padded),
    or tensors the descriptors cannot address. The interpreter loads by descriptors too."""
    head_dim = k.shape[-1]
    if target.gpu and target.capability < (9, 0):
        return None
    if head_dim != padded_head_dim(head_dim) or not (descriptor_aligned(k) and descriptor_aligned(v)):
        return None
    block = [1, block_n, 1, head_dim]
    return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), block) for t in (k, v))


def fwd_launch(call: FwdCall, cfg: LaunchConfig, target: Target) -> KernelLaunch:
    """_attn_fwd_kernel writing (or, with merge_state, merging into) call.out and call.lse, finished rows into
    call.final."""
    q, k, v, out, lse = call.q, call.k, call.v, call.out, call.lse
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    has_docs = call.q_doc_ids is not None
    kv_desc = _kv_descriptors(k, v, cfg.block_n, target)
    final_out, *final_strides, final_lo, final_hi = final_args(call.final, out)
    band, band_flags = band_args(call)
    return KernelLaunch(
        "portable.fwd",
        _attn_fwd_kernel,
        (triton.cdiv(seqlen_q, cfg.block_m), heads_q, batch),
        (
            q, *(kv_desc or (k, v)), out, lse, call.q_doc_ids if has_docs else lse,
            call.k_doc_ids if has_docs else lse, final_out, *strides(q), *strides(k), *strides(v), *strides(out),
            lse.stride(0), lse.stride(1), *final_strides, *_doc_strides(call), seqlen_q, seqlen_k, *band, final_lo,
            final_hi,
        ),
        dict(
            GROUP_SIZE=heads_q // heads_k, HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **band_flags, APPROX_TANH=_approx_tanh(q.dtype, target),
            HAS_DOCS=has_docs, MERGE_STATE=call.merge_state, HAS_FINAL_ROWS=call.final is not None,
            KV_TMA=kv_desc is not None,
            DOT_PRECISION=_dot_precision(q.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            enable_fp_fusion=True,  # exp2(s * qk_scale - m) as one FMA; explicit, as triton's default will flip
        ),
    )  # fmt: skip


def preprocess_launch(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, stats: torch.Tensor) -> KernelLaunch:
    """_attn_bwd_preprocess_kernel: the row stats (3, B, Hq, Sq) fp32 (ops/attn.py's attn_bwd_preprocess) from out,
    dout (B, Sq, Hq, D) with a contiguous last dim and lse (B, Hq, Sq) float64 contiguous."""
    batch, seqlen_q, heads_q, head_dim = out.shape
    return KernelLaunch(
        "portable.preprocess",
        _attn_bwd_preprocess_kernel,
        (triton.cdiv(seqlen_q, PREPROCESS_BLOCK_M), heads_q, batch),
        (out, dout, lse, stats, *strides(out), *strides(dout), seqlen_q, heads_q, stats.stride(0)),
        dict(
            HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), BLOCK_M=PREPROCESS_BLOCK_M,
            enable_fp_fusion=True,  # as the forward's: triton's default will flip
        ),
    )  # fmt: skip


def _bwd_common(call: BwdCall, target: Target) -> tuple[tuple, dict]:
    """The band arguments (launch.band_args) and the constexprs both backward kernels take on `target`."""
    band, band_flags = band_args(call)
    return band, dict(
        GROUP_SIZE=call.q.shape[2] // call.k.shape[2], HEAD_DIM=call.q.shape[-1],
        BLOCK_D=padded_head_dim(call.q.shape[-1]), **band_flags, APPROX_TANH=_approx_tanh(call.q.dtype, target),
        HAS_DOCS=call.q_doc_ids is not None,
        DOT_PRECISION=_dot_precision(call.q.dtype), LSE_LO=call.q.element_size() > 2,  # 16-bit: hi alone
        enable_fp_fusion=True,  # as the forward's: triton's default (fused multiply-adds on) will flip
    )  # fmt: skip


def _doc_args(call: BwdCall) -> tuple:
    """The kernels' QDoc, KDoc arguments: the document ids, or the row stats (never read) without documents."""
    return (call.q_doc_ids, call.k_doc_ids) if call.q_doc_ids is not None else (call.stats, call.stats)


def _doc_strides(call: FwdCall | BwdCall) -> tuple[int, int]:
    """The kernels' stride_qdb, stride_kdb: the batch strides of the (B, S) document ids (0 where one row of ids
    serves every batch row; ops/validation.py's check_doc_ids), 0 without documents."""
    if call.q_doc_ids is None:
        return 0, 0
    return call.q_doc_ids.stride(0), call.k_doc_ids.stride(0)


def dkdv_launch(call: BwdCall, cfg: LaunchConfig, target: Target) -> KernelLaunch:
    """_attn_bwd_dkdv_kernel adding dK, dV into call.dk, call.dv if call.add_dkdv, else storing them."""
    q, k, v, dout, dk, dv = call.q, call.k, call.v, call.dout, call.dk, call.dv
    batch, seqlen_q, _, _ = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    band, common = _bwd_common(call, target)
    return KernelLaunch(
        "portable.dkdv",
        _attn_bwd_dkdv_kernel,
        (triton.cdiv(seqlen_k, cfg.block_n), heads_k, batch),
        (
            q, k, v, dout, call.stats, dk, dv, *_doc_args(call),
            *strides(q), *strides(k), *strides(v), *strides(dout), *strides(dk), *strides(dv), *_doc_strides(call),
            seqlen_q, seqlen_k, heads_k, call.stats.stride(0), *band, call.softmax_scale,
        ),
        dict(
            **common, ACCUMULATE=call.add_dkdv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ),
    )  # fmt: skip


def dq_launch(call: BwdCall, cfg: LaunchConfig, target: Target) -> KernelLaunch:
    """_attn_bwd_dq_kernel adding dQ into call.dq if call.add_dq, else storing it, finished rows into
    call.dq_final."""
    q, k, v, dout, dq = call.q, call.k, call.v, call.dout, call.dq
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k = k.shape[1]
    final_dq, *final_strides, final_lo, final_hi = final_args(call.dq_final, dq)
    band, common = _bwd_common(call, target)
    return KernelLaunch(
        "portable.dq",
        _attn_bwd_dq_kernel,
        (triton.cdiv(seqlen_q, cfg.block_m), heads_q, batch),
        (
            q, k, v, dout, call.stats, dq, *_doc_args(call), final_dq,
            *strides(q), *strides(k), *strides(v), *strides(dout), *strides(dq), *final_strides,
            seqlen_q, seqlen_k, heads_q, call.stats.stride(0), *band, call.softmax_scale, *_doc_strides(call),
            final_lo, final_hi,
        ),
        dict(
            **common, ACCUMULATE=call.add_dq, HAS_FINAL_ROWS=call.dq_final is not None,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ),
    )  # fmt: skip
