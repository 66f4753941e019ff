"""FinalRows: the rows a call finishes are written rounded into their own tensor, bit for bit the rounding of
what the call would have stored, and nothing else changes (ops/final_rows.py)."""

import pytest
import torch

from ringattn.ops import FinalRows, attn_bwd, attn_bwd_ref, attn_fwd, attn_fwd_merge_, attn_fwd_merge_ref_, attn_fwd_ref
from tests.utils import DEVICE, DTYPES, make_qkv

FINAL_DTYPE = torch.float16  # rounding that differs from the fp32 state on every device
ROWS = range(20, 45)  # of 50 query rows: crosses a tile boundary on the CPU (32) and the GPU (64, 128)
OPS = {"kernel": (attn_fwd, attn_fwd_merge_, attn_bwd), "reference": (attn_fwd_ref, attn_fwd_merge_ref_, attn_bwd_ref)}


def _inputs(causal: bool, seed: int):
    q, k, v, dout = make_qkv(1, 50, 60, 4, 2, 32, DTYPES[0], seed=seed)
    return q, k, v, dout


def _final_like(t: torch.Tensor) -> FinalRows:
    return FinalRows(torch.full(t.shape, float("nan"), dtype=FINAL_DTYPE, device=t.device), ROWS)


def _check_final(final: FinalRows, expected: torch.Tensor) -> None:
    """final.out holds expected's ROWS rounded, bit for bit, and its other rows are untouched (NaN)."""
    inside = slice(ROWS.start, ROWS.stop)
    assert torch.equal(final.out[:, inside], expected[:, inside].to(FINAL_DTYPE))
    outside = torch.ones(final.out.shape[1], dtype=torch.bool)
    outside[inside] = False
    assert final.out[:, outside].isnan().all()


def _outside_rows(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t[:, : ROWS.start], t[:, ROWS.stop :]], dim=1)


def _keeps_rows(ops) -> bool:
    """The references keep final's rows in their result too, so their tests compare within one call: two calls
    need not give the same bits on the CPU (its BLAS may sum in another order for differently aligned buffers;
    one such mismatch was seen, once). The kernels, which split the rows off in their stores, are compared with
    a call without final, bit for bit."""
    return ops is OPS["reference"]


@pytest.mark.parametrize("ops", OPS.values(), ids=OPS.keys())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_writes_finished_rows_rounded(causal, ops):
    """attn_fwd with an fp32 out (the ring's step 0): final gets the rounded rows, lse and out's other rows the
    same bits as without final."""
    fwd = ops[0]
    q, k, v, _ = _inputs(causal, seed=3)
    final = _final_like(q)
    got_out, got_lse = fwd(q, k, v, 0.3, causal, torch.float32, final=final)
    if _keeps_rows(ops):
        _check_final(final, got_out)
        return
    out, lse = fwd(q, k, v, 0.3, causal, torch.float32)
    _check_final(final, out)
    assert torch.equal(got_lse, lse) and torch.equal(_outside_rows(got_out), _outside_rows(out))


@pytest.mark.parametrize("ops", OPS.values(), ids=OPS.keys())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_merge_writes_finished_rows_rounded(causal, ops):
    """attn_fwd_merge_ (a later ring step): final gets the merged rows rounded; the state's lse and its other
    rows are merged as without final."""
    fwd, fwd_merge_ = ops[:2]
    q, k, v, _ = _inputs(causal, seed=4)
    state = fwd(q, k, v, 0.3, causal, torch.float32)
    k2, v2 = torch.randn_like(k), torch.randn_like(v)
    with_final = [t.clone() for t in state]
    final = _final_like(q)
    fwd_merge_(q, k2, v2, 0.3, causal, *with_final, final=final)
    if _keeps_rows(ops):
        _check_final(final, with_final[0])
        return
    merged = [t.clone() for t in state]
    fwd_merge_(q, k2, v2, 0.3, causal, *merged)
    _check_final(final, merged[0])
    assert torch.equal(with_final[1], merged[1])
    assert torch.equal(_outside_rows(with_final[0]), _outside_rows(merged[0]))


@pytest.mark.parametrize("ops", OPS.values(), ids=OPS.keys())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("add_dq", [True, False], ids=["add", "store"])
def test_bwd_writes_finished_dq_rows_rounded(add_dq, causal, ops):
    """attn_bwd with accumulators: dq_final gets the rows of the fp32 dQ sum (after the add, or the stored dQ)
    rounded; dK, dV and dQ's other rows are the same bits as without it."""
    fwd, bwd = ops[0], ops[2]
    q, k, v, dout = _inputs(causal, seed=5)
    out, lse = fwd(q, k, v, 0.3, causal)
    starts = [torch.randn(t.shape, device=DEVICE) for t in (q, k, v)]
    with_final = [s.clone() for s in starts]
    final = _final_like(q)
    bwd(dout, q, k, v, out, lse, 0.3, causal, None, *with_final, add_dq=add_dq, dq_final=final)
    if _keeps_rows(ops):
        _check_final(final, with_final[0])
        return
    plain = [s.clone() for s in starts]
    bwd(dout, q, k, v, out, lse, 0.3, causal, None, *plain, add_dq=add_dq)
    _check_final(final, plain[0])
    assert torch.equal(_outside_rows(with_final[0]), _outside_rows(plain[0]))
    assert torch.equal(with_final[1], plain[1]) and torch.equal(with_final[2], plain[2])


@pytest.mark.parametrize("ops", OPS.values(), ids=OPS.keys())
def test_bad_final_rows_raise(ops):
    fwd, fwd_merge_, bwd = ops
    q, k, v, dout = _inputs(False, seed=6)
    full = torch.empty(q.shape, dtype=FINAL_DTYPE, device=q.device)
    with pytest.raises(ValueError, match=r"final.out must have shape \(1, 50, 4, 32\)"):
        fwd(q, k, v, 0.3, False, final=FinalRows(full[:, :49], ROWS))
    with pytest.raises(ValueError, match=r"final.rows must be a range of step 1 inside \[0, 50\], got range\(40, 51\)"):
        fwd(q, k, v, 0.3, False, final=FinalRows(full, range(40, 51)))
    with pytest.raises(TypeError, match="final must be a FinalRows"):
        fwd(q, k, v, 0.3, False, final=(full, ROWS))
    with pytest.raises(TypeError, match="final.out must be a floating-point tensor"):
        fwd(q, k, v, 0.3, False, final=FinalRows(full.to(torch.int32), ROWS))
    state = fwd(q, k, v, 0.3, False, torch.float32)
    with pytest.raises(ValueError, match="final.rows must be a range of step 1"):
        fwd_merge_(q, k, v, 0.3, False, *state, final=FinalRows(full, range(0, 50, 2)))
    out, lse = fwd(q, k, v, 0.3, False)
    with pytest.raises(ValueError, match="dq_final needs the accumulators"):
        bwd(dout, q, k, v, out, lse, 0.3, False, dq_final=FinalRows(full, ROWS))
