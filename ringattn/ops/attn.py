"""Launchers of the attention kernels: validate, allocate, pick a launch config, launch.

The pure-PyTorch twins with the same signatures live in ops/attn_ref.py.
Layout everywhere: q, out (B, Sq, Hq, D); k, v (B, Sk, Hkv, D); lse, delta (B, Hq, Sq) fp32,
natural log. Causal masking is aligned bottom-right (row i sees keys j <= i + Sk - Sq).
"""

import contextlib
import math
import os
from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..kernels.attn_bwd import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_bwd_preprocess_kernel
from ..kernels.attn_bwd_ws import _attn_bwd_dkdv_ws_kernel, _attn_bwd_dq_ws_kernel
from ..kernels.attn_fwd import _attn_fwd_kernel
from ..kernels.attn_fwd_ws import _attn_fwd_ws_kernel
from .final_rows import FinalRows, check_dq_final, check_final_rows
from .gluon_fwd import fwd_gluon_ready
from .streams import bwd_on_two_streams, run_side_by_side
from .validation import check_attn_inputs, check_attn_state, check_doc_ids, check_runnable_device
from .warp_spec import descriptor_aligned, dkdv_ws_ready, dq_ws_ready, fwd_ws_ready, run_with_scratch

LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and compiler hints of one launch."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _padded_head_dim(head_dim: int) -> int:
    """Head dim rounded up to a power of two of at least 16 (tl.dot's smallest K)."""
    return max(16, triton.next_power_of_2(head_dim))


_INTERPRETER_CONFIG = LaunchConfig(32, 32, 4, 1)  # numpy does the work: few large tiles
# Per kernel, (largest padded head dim, config) pairs; the first that fits wins. The 16-bit configs up to
# D = 128 come from launch/config_sweep.py on the H200 (docs/performance.md, "Launch configs"). For dK/dV,
# block_n keys belong to one program and block_m query rows are a loop step; for dQ the other way round.
_CUDA_16BIT_CONFIGS = {
    "fwd": ((64, LaunchConfig(128, 64, 4, 3)), (128, LaunchConfig(128, 128, 8, 3)), (256, LaunchConfig(64, 64, 8, 2))),
    "dkdv": ((64, LaunchConfig(64, 64, 4, 3)), (128, LaunchConfig(64, 64, 4, 2)), (256, LaunchConfig(32, 32, 4, 1))),
    "dq": ((128, LaunchConfig(128, 64, 8, 3)), (256, LaunchConfig(32, 32, 4, 1))),
    # num_warps is the consumers' warpgroup: the partitioner adds a producer one and splits the consumers in two
    "fwd_ws": ((128, LaunchConfig(128, 128, 4, 2)),),
    # the Gluon forward: num_warps is the first consumer's warpgroup (the kernel adds the second and a producer),
    # num_stages the depth of its key and value rings (launch/config_sweep.py timed 2 and 3 alike at D = 128)
    "fwd_gluon": ((64, LaunchConfig(128, 128, 4, 3)), (128, LaunchConfig(128, 128, 4, 2))),
    "dkdv_ws": ((128, LaunchConfig(64, 128, 4, 2)),),
    "dq_ws": ((128, LaunchConfig(128, 64, 4, 2)),),
}
_CUDA_FP32_CONFIGS = {
    "fwd": ((128, LaunchConfig(64, 32, 4, 2)), (256, LaunchConfig(32, 32, 4, 1))),
    "dkdv": ((256, LaunchConfig(32, 32, 4, 1)),),
    "dq": ((256, LaunchConfig(32, 32, 4, 1)),),
}


def _launch_config(kernel: str, block_d: int, dtype: torch.dtype, device: torch.device) -> LaunchConfig:
    """The config of `kernel` ("fwd", "dkdv", "dq" or a warp-specialised one, "fwd_ws", "dkdv_ws", "dq_ws") for a
    padded head dim, dtype and device."""
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    table = (_CUDA_FP32_CONFIGS if dtype == torch.float32 else _CUDA_16BIT_CONFIGS)[kernel]
    return next(config for max_block_d, config in table if block_d <= max_block_d)


def _fwd_config(block_d: int, dtype: torch.dtype, device: torch.device) -> LaunchConfig:
    return _launch_config("fwd", block_d, dtype, device)


def _bwd_dkdv_config(block_d: int, dtype: torch.dtype, device: torch.device) -> LaunchConfig:
    return _launch_config("dkdv", block_d, dtype, device)


def _bwd_dq_config(block_d: int, dtype: torch.dtype, device: torch.device) -> LaunchConfig:
    return _launch_config("dq", block_d, dtype, device)


def _fwd_ws_config(block_d: int, dtype: torch.dtype, device: torch.device) -> LaunchConfig:
    return _launch_config("fwd_ws", block_d, dtype, device)


def _fwd_gluon_config(block_d: int, dtype: torch.dtype, device: torch.device) -> LaunchConfig:
    return _launch_config("fwd_gluon", block_d, dtype, device)


def _bwd_dkdv_ws_config(block_d: int, dtype: torch.dtype, device: torch.device) -> LaunchConfig:
    return _launch_config("dkdv_ws", block_d, dtype, device)


def _bwd_dq_ws_config(block_d: int, dtype: torch.dtype, device: torch.device) -> LaunchConfig:
    return _launch_config("dq_ws", block_d, dtype, device)


def _bwd_configs(block_d: int, dtype: torch.dtype, device: torch.device) -> tuple[LaunchConfig, LaunchConfig]:
    """(dK/dV config, dQ config) of one backward."""
    return _bwd_dkdv_config(block_d, dtype, device), _bwd_dq_config(block_d, dtype, device)


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full fp32 ("ieee"), never tf32: exactness over speed for fp32.
    (fp16/bf16 dots ignore the setting.)"""
    return "ieee" if dtype == torch.float32 else "tf32"


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a (B, S, H, D) tensor whose last dim is contiguous."""
    return t.stride(0), t.stride(1), t.stride(2)


def _device_guard(t: torch.Tensor):
    """Launch on t's GPU, whichever device is current."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def fwd_tma_enabled() -> bool:
    """$RINGATTN_FWD_TMA: "1" (default) lets the forward load K/V tiles by TMA where it can, "0" never."""
    value = os.environ.get("RINGATTN_FWD_TMA", "1")
    if value not in ("0", "1"):
        raise ValueError(f"$RINGATTN_FWD_TMA must be 0 or 1, got {value!r}")
    return value == "1"


def _tma_ready(t: torch.Tensor, head_dim: int, block_d: int) -> bool:
    """Whether TMA can load t's (B, S, H, D) tiles: Hopper or newer (or the interpreter), D a power of two
    (no padding), the descriptors' alignment (ops/warp_spec.py)."""
    if t.is_cuda and torch.cuda.get_device_capability(t.device) < (9, 0):
        return False
    return head_dim == block_d and descriptor_aligned(t)


def _kv_descriptors(k, v, head_dim: int, block_d: int, block_n: int):
    """TMA descriptors of k and v (B, Sk, Hkv, D) with block (1, block_n, 1, D), or None: TMA switched off
    ($RINGATTN_FWD_TMA=0) or unable to load them (pointer loads then)."""
    if not (fwd_tma_enabled() and _tma_ready(k, head_dim, block_d) and _tma_ready(v, head_dim, block_d)):
        return None
    block = [1, block_n, 1, head_dim]
    return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), block) for t in (k, v))


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch, built but not run: kernel[grid](*args, **kwargs). launch/kernel_resources.py
    compiles the same launches for a GPU architecture without running them."""

    kernel: triton.JITFunction
    grid: tuple[int, int, int]
    args: tuple
    kwargs: dict
    scratch: bool = False  # the kernel makes tensor descriptors, in global scratch memory (ops/warp_spec.py)

    def __call__(self) -> None:
        if self.scratch:
            run_with_scratch(self._launch)
        else:
            self._launch()

    def _launch(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)


def _final_args(final: FinalRows | None, out: torch.Tensor) -> tuple:
    """(tensor, its batch, seq and head strides, first row, end row) of a kernel's HAS_FINAL arguments; out and
    empty rows when there is none (the kernel then reads none of them)."""
    if final is None:
        return out, 0, 0, 0, 0, 0
    return final.out, *_strides(final.out), final.rows.start, final.rows.stop


def _fwd_launch(
    q, k, v, softmax_scale, causal, out, lse, q_doc_ids, k_doc_ids, merge_state: bool, final: FinalRows | None,
    cfg: LaunchConfig,
) -> KernelLaunch:  # fmt: skip
    """_attn_fwd_kernel writing (or, with merge_state, merging into) out and lse, finished rows into final;
    inputs checked."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    block_d = _padded_head_dim(head_dim)
    has_docs = q_doc_ids is not None
    kv_desc = _kv_descriptors(k, v, head_dim, block_d, cfg.block_n)
    final_out, *final_strides, final_lo, final_hi = _final_args(final, out)
    return KernelLaunch(
        _attn_fwd_kernel,
        (triton.cdiv(seqlen_q, cfg.block_m), heads_q, batch),
        (
            q, *(kv_desc or (k, v)), out, lse, q_doc_ids if has_docs else lse, k_doc_ids if has_docs else lse,
            final_out, *_strides(q), *_strides(k), *_strides(v), *_strides(out), lse.stride(0), lse.stride(1),
            *final_strides, seqlen_q, seqlen_k, softmax_scale * LOG2E, final_lo, final_hi,
        ),
        dict(
            GROUP_SIZE=heads_q // heads_k, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            CAUSAL=bool(causal), HAS_DOCS=has_docs, MERGE_STATE=merge_state, HAS_FINAL=final is not None,
            KV_TMA=kv_desc is not None,
            DOT_PRECISION=_dot_precision(q.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            enable_fp_fusion=True,  # exp2(s * qk_scale - m) as one FMA; explicit, as triton's default will flip
        ),
    )  # fmt: skip


def _fwd_ws_launch(q, k, v, softmax_scale, causal, out, lse, merge_state: bool) -> KernelLaunch:
    """_attn_fwd_ws_kernel writing (or, with merge_state, merging into) out and lse; inputs checked and
    fwd_ws_ready."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    cfg = _fwd_ws_config(head_dim, q.dtype, q.device)
    mask_keys = bool(causal) or seqlen_k % cfg.block_n != 0
    positions = _ws_positions(max(triton.cdiv(seqlen_k, cfg.block_n) * cfg.block_n, seqlen_q), mask_keys, lse)
    return KernelLaunch(
        _attn_fwd_ws_kernel,
        (triton.cdiv(seqlen_q, cfg.block_m), heads_q, batch),
        (
            q, k, v, out, lse, positions, *_strides(q), *_strides(k), *_strides(v), *_strides(out),
            lse.stride(0), lse.stride(1), seqlen_q, seqlen_k, positions.numel(), softmax_scale * LOG2E,
        ),
        dict(
            HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_SIZE=heads_q // heads_k,
            CAUSAL=bool(causal), MASK_KEYS=mask_keys, MERGE_STATE=merge_state,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            enable_fp_fusion=True,  # as _fwd_launch's
        ),
        scratch=True,
    )  # fmt: skip


# the Gluon forward's registers per thread at launch: 12 warps x 32 x 168 fill the SM's 64K registers, which the
# kernel then moves to 240 for each consumer and 24 for the producer
GLUON_MAXNREG = 168


def _fwd_gluon_launch(q, k, v, softmax_scale, causal, out, lse, merge_state: bool) -> KernelLaunch:
    """_attn_fwd_gluon_kernel writing (or, with merge_state, merging into) out and lse; inputs checked and
    fwd_gluon_ready."""
    from ..kernels.attn_fwd_gluon import _attn_fwd_gluon_kernel  # Gluon of triton 3.9: imported once it is there

    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    cfg = _fwd_gluon_config(head_dim, q.dtype, q.device)
    return KernelLaunch(
        _attn_fwd_gluon_kernel,
        (triton.cdiv(seqlen_q, cfg.block_m), heads_q, batch),
        (
            q, k, v, out, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(out), lse.stride(0),
            lse.stride(1), seqlen_q, seqlen_k, softmax_scale * LOG2E,
        ),
        dict(
            HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_SIZE=heads_q // heads_k,
            CAUSAL=bool(causal), MERGE_STATE=merge_state, NUM_BUFFERS=cfg.num_stages, num_warps=cfg.num_warps,
            maxnreg=GLUON_MAXNREG,
            enable_fp_fusion=True,  # as _fwd_launch's
        ),
        scratch=True,
    )  # fmt: skip


def _pick_fwd_launch(
    q, k, v, softmax_scale, causal, out, lse, q_doc_ids, k_doc_ids, merge_state: bool, final: FinalRows | None
) -> KernelLaunch:
    """Where $RINGATTN_FWD_TMA allows descriptors: _fwd_gluon_launch where fwd_gluon_ready, else _fwd_ws_launch where
    fwd_ws_ready; else _fwd_launch with the launch config of q's head dim, dtype and device."""
    has_docs, has_final = q_doc_ids is not None, final is not None
    if fwd_tma_enabled():
        if fwd_gluon_ready(q, k, v, out, lse, has_docs, merge_state, has_final):
            return _fwd_gluon_launch(q, k, v, softmax_scale, causal, out, lse, merge_state)
        if fwd_ws_ready(q, k, v, out, lse, causal, has_docs, merge_state, has_final):
            return _fwd_ws_launch(q, k, v, softmax_scale, causal, out, lse, merge_state)
    cfg = _fwd_config(_padded_head_dim(q.shape[-1]), q.dtype, q.device)
    return _fwd_launch(q, k, v, softmax_scale, causal, out, lse, q_doc_ids, k_doc_ids, merge_state, final, cfg)


def _launch_fwd(
    q, k, v, softmax_scale, causal, out, lse, q_doc_ids, k_doc_ids, merge_state: bool, final: FinalRows | None
) -> None:
    launch = _pick_fwd_launch(q, k, v, softmax_scale, causal, out, lse, q_doc_ids, k_doc_ids, merge_state, final)
    with _device_guard(q):
        launch()


def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    out_dtype: torch.dtype | None = None,
    q_doc_ids: torch.Tensor | None = None,
    k_doc_ids: torch.Tensor | None = None,
    final: FinalRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention forward.

    Args:
        q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D), Hq % Hkv == 0; any strides, last dim contiguous
            preferred (otherwise copied). D a multiple of 8 up to 256; fp16, bf16 or fp32.
        softmax_scale: multiplies q k^T before the softmax; positive (the kernel folds it into the row max).
        causal: bottom-right aligned causal mask.
        out_dtype: dtype of out (default q.dtype).
        q_doc_ids, k_doc_ids: optional (Sq,) and (Sk,) int32 document ids, non-decreasing along the
            rows (packed variable-length sequences): row i sees key j only if their ids are equal
            (and, with causal, j <= i + Sk - Sq). Both or neither.
        final: rows of out to write, rounded, into final.out instead (ops/final_rows.py); out's rows there are
            then unspecified.
    Returns:
        out (B, Sq, Hq, D) and lse (B, Hq, Sq) fp32 natural log; rows that see no key get out 0, lse -inf.
    Raises:
        ValueError, TypeError: bad shapes, dtypes or devices (see check_attn_inputs, check_doc_ids,
            check_final_rows).
        RuntimeError: tensors on a device the kernels cannot run on.
    """
    check_attn_inputs(q, k, v)
    check_runnable_device(q)
    q_doc_ids, k_doc_ids = check_doc_ids(q_doc_ids, k_doc_ids, q, k)
    check_final_rows(final, q)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    _launch_fwd(q, k, v, softmax_scale, causal, out, lse, q_doc_ids, k_doc_ids, False, final)
    return out, lse


def attn_fwd_merge_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_doc_ids: torch.Tensor | None = None,
    k_doc_ids: torch.Tensor | None = None,
    final: FinalRows | None = None,
) -> None:
    """Fused attention forward merged into a running state in place: the ring's step, with no merge pass.

    (out, lse) becomes the log-sum-exp merge (ops/merge.py) of itself with attn_fwd(q, k, v, ...).
    Args:
        q, k, v, softmax_scale, causal, q_doc_ids, k_doc_ids, final: as in attn_fwd (final's rows of the merged
            out go to final.out; lse is updated in every row).
        out: (B, Sq, Hq, D) fp32 running output, last dim contiguous (views of a larger state are fine).
        lse: (B, Hq, Sq) fp32 running lse, natural log, -inf for rows without keys yet; last dim contiguous.
    Raises:
        as attn_fwd; ValueError or TypeError for a state of the wrong shape, dtype, device or strides.
    """
    check_attn_inputs(q, k, v)
    check_runnable_device(q)
    check_attn_state(out, lse, q)
    q_doc_ids, k_doc_ids = check_doc_ids(q_doc_ids, k_doc_ids, q, k)
    check_final_rows(final, q)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    _launch_fwd(q, k, v, softmax_scale, causal, out, lse, q_doc_ids, k_doc_ids, True, final)


def attn_bwd_preprocess(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """delta = rowsum(dout * out) in fp32: out, dout (B, Sq, Hq, D) -> delta (B, Hq, Sq)."""
    check_runnable_device(out)
    out, dout = _last_dim_contiguous(out), _last_dim_contiguous(dout)
    batch, seqlen_q, heads_q, head_dim = out.shape
    delta = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=out.device)
    block_m = 64
    with _device_guard(out):
        _attn_bwd_preprocess_kernel[(triton.cdiv(seqlen_q, block_m), heads_q, batch)](
            out, dout, delta, *_strides(out), *_strides(dout), seqlen_q, heads_q,
            HEAD_DIM=head_dim, BLOCK_D=_padded_head_dim(head_dim), BLOCK_M=block_m,
            enable_fp_fusion=True,  # as the forward's: triton's default will flip
        )  # fmt: skip
    return delta


def _dkdv_ws_launch(dout, q, k, v, lse, delta, dk, dv, positions, qk_scale, softmax_scale, causal) -> KernelLaunch:
    """_attn_bwd_dkdv_ws_kernel storing dK, dV into dk, dv; inputs checked and dkdv_ws_ready, lse and delta
    contiguous, positions the causal mask's (_ws_positions); qk_scale = softmax_scale * log2(e), as _bwd_launches
    computes it."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    cfg = _bwd_dkdv_ws_config(head_dim, q.dtype, q.device)  # head_dim: 64 or 128, its own padding
    return KernelLaunch(
        _attn_bwd_dkdv_ws_kernel,
        (triton.cdiv(seqlen_k, cfg.block_n), heads_k, batch),
        (
            q, k, v, dout, lse, delta, dk, dv, positions,
            *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dk), *_strides(dv),
            seqlen_q, seqlen_k, heads_k, qk_scale, softmax_scale,
        ),
        dict(
            HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_SIZE=heads_q // heads_k,
            CAUSAL=bool(causal), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            enable_fp_fusion=True,  # as the other kernels'
        ),
        scratch=True,
    )  # fmt: skip


def _dq_ws_launch(dout, q, k, v, lse, delta, dq, positions, qk_scale, softmax_scale, causal, add_dq) -> KernelLaunch:
    """_attn_bwd_dq_ws_kernel adding dQ into dq if add_dq, else storing it; inputs checked and dq_ws_ready, the
    rest as _dkdv_ws_launch's."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    cfg = _bwd_dq_ws_config(head_dim, q.dtype, q.device)
    return KernelLaunch(
        _attn_bwd_dq_ws_kernel,
        (triton.cdiv(seqlen_q, cfg.block_m), heads_q, batch),
        (
            q, k, v, dout, lse, delta, dq, positions,
            *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dq),
            seqlen_q, seqlen_k, heads_q, qk_scale, softmax_scale,
        ),
        dict(
            HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_SIZE=heads_q // heads_k,
            CAUSAL=bool(causal), ACCUMULATE=add_dq, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            enable_fp_fusion=True,
        ),
        scratch=True,
    )  # fmt: skip


def _ws_positions(length: int, needed: bool, like: torch.Tensor) -> torch.Tensor:
    """Row and key positions 0, 1, ..., length - 1 (int32) that the warp-specialised kernels' masks load (the
    kernels' docstrings say why they are loaded); `like` (any tensor on the device, never read) when no mask needs
    them."""
    return torch.arange(length, dtype=torch.int32, device=like.device) if needed else like


def _bwd_launches(
    dout, q, k, v, lse, delta, dq, dk, dv, softmax_scale, causal, q_doc_ids, k_doc_ids,
    add_dq: bool, add_dkdv: bool, dq_final: FinalRows | None, dkdv_cfg: LaunchConfig, dq_cfg: LaunchConfig,
) -> tuple[KernelLaunch, KernelLaunch]:  # fmt: skip
    """_attn_bwd_dkdv_kernel (or, where dkdv_ws_ready, _attn_bwd_dkdv_ws_kernel) then _attn_bwd_dq_kernel (or, where
    dq_ws_ready, _attn_bwd_dq_ws_kernel), adding dQ into dq if add_dq and dK, dV into dk, dv if add_dkdv, else
    storing them, and dQ's finished rows into dq_final; inputs checked, lse and delta contiguous."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    block_d = _padded_head_dim(head_dim)
    has_docs = q_doc_ids is not None
    docs = (q_doc_ids, k_doc_ids) if has_docs else (lse, lse)
    common = dict(
        GROUP_SIZE=heads_q // heads_k, HEAD_DIM=head_dim, BLOCK_D=block_d, CAUSAL=bool(causal), HAS_DOCS=has_docs,
        DOT_PRECISION=_dot_precision(q.dtype),
        enable_fp_fusion=True,  # as the forward's: triton's default (fused multiply-adds on) will flip
    )  # fmt: skip
    qk_scale = softmax_scale * LOG2E
    dkdv_ws = dkdv_ws_ready(q, k, v, dout, lse, delta, dk, dv, causal, has_docs, add_dkdv)
    dq_ws = dq_ws_ready(q, k, v, dout, lse, delta, dq, causal, has_docs, add_dq, dq_final is not None)
    positions = _ws_positions(max(seqlen_q, seqlen_k), causal and (dkdv_ws or dq_ws), lse)
    if dkdv_ws:
        dkdv = _dkdv_ws_launch(dout, q, k, v, lse, delta, dk, dv, positions, qk_scale, softmax_scale, causal)
    else:
        dkdv = KernelLaunch(
            _attn_bwd_dkdv_kernel,
            (triton.cdiv(seqlen_k, dkdv_cfg.block_n), heads_k, batch),
            (
                q, k, v, dout, lse, delta, dk, dv, *docs,
                *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dk), *_strides(dv),
                seqlen_q, seqlen_k, heads_k, qk_scale, softmax_scale,
            ),
            dict(
                **common, ACCUMULATE=add_dkdv, BLOCK_M=dkdv_cfg.block_m, BLOCK_N=dkdv_cfg.block_n,
                num_warps=dkdv_cfg.num_warps, num_stages=dkdv_cfg.num_stages,
            ),
        )  # fmt: skip
    if dq_ws:
        return dkdv, _dq_ws_launch(dout, q, k, v, lse, delta, dq, positions, qk_scale, softmax_scale, causal, add_dq)
    final_dq, *final_strides, final_lo, final_hi = _final_args(dq_final, dq)
    dq_launch = KernelLaunch(
        _attn_bwd_dq_kernel,
        (triton.cdiv(seqlen_q, dq_cfg.block_m), heads_q, batch),
        (
            q, k, v, dout, lse, delta, dq, *docs, final_dq,
            *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dq), *final_strides,
            seqlen_q, seqlen_k, heads_q, qk_scale, softmax_scale, final_lo, final_hi,
        ),
        dict(
            **common, ACCUMULATE=add_dq, HAS_FINAL=dq_final is not None, BLOCK_M=dq_cfg.block_m,
            BLOCK_N=dq_cfg.block_n,
            num_warps=dq_cfg.num_warps, num_stages=dq_cfg.num_stages,
        ),
    )  # fmt: skip
    return dkdv, dq_launch


def attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    delta: torch.Tensor | None = None,
    dq_acc: torch.Tensor | None = None,
    dk_acc: torch.Tensor | None = None,
    dv_acc: torch.Tensor | None = None,
    q_doc_ids: torch.Tensor | None = None,
    k_doc_ids: torch.Tensor | None = None,
    add_dq: bool = True,
    add_dkdv: bool = True,
    dq_final: FinalRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused attention backward: gradients of out = softmax(q k^T * scale) v.

    Args:
        dout, out: (B, Sq, Hq, D); q (B, Sq, Hq, D); k, v (B, Sk, Hkv, D).
        lse: (B, Hq, Sq) fp32 natural log, the softmax normaliser of each row; in the ring it is the
            global one, so P computed here is this block's slice of the global softmax.
        delta: (B, Hq, Sq) fp32 rowsum(dout * out); computed from out and dout when None.
        dq_acc, dk_acc, dv_acc: optional buffers shaped like q, k, v (the ring passes fp32
            accumulators); when given, the gradients are added to them in place and they are returned.
            All three or none.
        q_doc_ids, k_doc_ids: document ids as in attn_fwd.
        add_dq, add_dkdv: with accumulators, False stores dQ into dq_acc (add_dq), or dK and dV into dk_acc and
            dv_acc (add_dkdv), instead of adding: whatever they held is ignored, not read. The ring stores both
            at its first step, and dK, dV alone (its share of a block in transit) at later ones.
        dq_final: with accumulators, rows of dq (the sum, after add_dq) to write, rounded, into dq_final.out
            instead of dq_acc, whose rows there are then unspecified (ops/final_rows.py): the ring's last
            step of those rows.
    Returns:
        (dq, dk, dv), new tensors in q's dtype unless accumulators were given.
    Raises:
        ValueError, TypeError: bad shapes, dtypes or devices; accumulators not all given, or dq_final without them.
        RuntimeError: tensors on a device the kernels cannot run on.
    """
    check_attn_inputs(q, k, v)
    check_runnable_device(q)
    q_doc_ids, k_doc_ids = check_doc_ids(q_doc_ids, k_doc_ids, q, k)
    q, k, v, dout = (_last_dim_contiguous(t) for t in (q, k, v, dout))
    lse = lse.contiguous()
    delta = attn_bwd_preprocess(out, dout) if delta is None else delta.contiguous()
    accumulate = dq_acc is not None
    if accumulate != (dk_acc is not None) or accumulate != (dv_acc is not None):
        raise ValueError("dq_acc, dk_acc and dv_acc must be given together or not at all")
    check_dq_final(dq_final, q, dq_acc)
    if accumulate:
        for name, acc, ref in (("dq_acc", dq_acc, q), ("dk_acc", dk_acc, k), ("dv_acc", dv_acc, v)):
            if acc.shape != ref.shape or acc.stride(-1) != 1:
                raise ValueError(f"{name} must have shape {tuple(ref.shape)} with a contiguous last dim")
        dq, dk, dv = dq_acc, dk_acc, dv_acc
    else:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    cfgs = _bwd_configs(_padded_head_dim(q.shape[-1]), q.dtype, q.device)
    launches = _bwd_launches(
        dout, q, k, v, lse, delta, dq, dk, dv, softmax_scale, causal, q_doc_ids, k_doc_ids,
        accumulate and add_dq, accumulate and add_dkdv, dq_final, *cfgs,
    )  # fmt: skip
    with _device_guard(q):
        if bwd_on_two_streams(q, k, causal):  # dK/dV on a side stream, dQ on the current one (ops/streams.py)
            run_side_by_side(*launches, q.device)
        else:
            for launch in launches:
                launch()
    return dq, dk, dv
