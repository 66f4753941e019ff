"""Sliding windows and logit soft-capping through flash_attn_func and the launchers, against a float64 reference
under the tolerance rule; flash-attn's argument checks."""

import sys

import pytest
import torch

import ringattn
from ringattn.ops import LaunchConfig, attn_bwd, attn_fwd, override_configs
from ringattn.ops.calls import key_band
from tests.utils import DEVICE, DTYPES, check_against_reference, make_qkv

# (seqlen_q, seqlen_k, window_size, causal): windows of 0 and 1, longer than the sequence, left != right, one
# side unlimited, with Sq != Sk (bottom-right aligned), with causal
WINDOW_CASES = {
    "97-w0-0": (97, 97, (0, 0), False),
    "97-w1-0": (97, 97, (1, 0), False),
    "97-w5-3": (97, 97, (5, 3), False),
    "97-w-1-4": (97, 97, (-1, 4), False),
    "97-w9--1": (97, 97, (9, -1), False),
    "97-w500-500": (97, 97, (500, 500), False),
    "97-w7-causal": (97, 97, (7, -1), True),
    "97-w7-3-causal": (97, 97, (7, 3), True),
    "17-97-w4-2": (17, 97, (4, 2), False),
    "97-17-w3-1": (97, 17, (3, 1), False),
    "129-1-w0-0": (129, 1, (0, 0), False),
    "33-65-w16-causal": (33, 65, (16, -1), True),
}


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_sliding_window_matches_reference(case):
    seqlen_q, seqlen_k, window_size, causal = WINDOW_CASES[case]
    q, k, v, dout = make_qkv(1, seqlen_q, seqlen_k, 2, 1, 40, DTYPES[0], seed=seqlen_q + 7 * seqlen_k)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ringattn.flash_attn_func(q, k, v, causal=causal, window_size=window_size, return_lse=True)
    out.backward(dout)
    window = tuple(None if side == -1 else side for side in window_size)
    check_against_reference(q, k, v, dout, 40**-0.5, causal, (out, lse, q.grad, k.grad, v.grad), window=window)


@pytest.mark.parametrize("softcap", [0.5, 5.0, 50.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_matches_reference(causal, softcap):
    """Scores of about +-8 (q scaled up), so that tanh saturates at the small caps and is near linear at 50."""
    q, k, v, dout = make_qkv(1, 77, 77, 2, 1, 32, DTYPES[0], seed=int(softcap * 10))
    q = (q * 3).requires_grad_()
    k, v = (t.requires_grad_() for t in (k, v))
    out, lse = ringattn.flash_attn_func(q, k, v, causal=causal, softcap=softcap, return_lse=True)
    out.backward(dout)
    check_against_reference(q, k, v, dout, 32**-0.5, causal, (out, lse, q.grad, k.grad, v.grad), softcap=softcap)


def test_softcap_with_window_matches_reference():
    q, k, v, dout = make_qkv(1, 70, 70, 2, 2, 64, DTYPES[0], seed=11)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ringattn.flash_attn_func(q, k, v, causal=True, window_size=(10, 0), softcap=2.0, return_lse=True)
    out.backward(dout)
    check_against_reference(q, k, v, dout, 64**-0.5, True, (out, lse, q.grad, k.grad, v.grad), window=(10, None),
                            softcap=2.0)  # fmt: skip


DTYPES_16BIT = [torch.float16, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float16]  # the interpreter: no bf16
TILES = {  # forward, dK/dV and dQ tiles of unequal sides, so that the window's edges cross tiles every way
    "16x64": (LaunchConfig(16, 64, 4, 1), LaunchConfig(64, 16, 4, 1), LaunchConfig(16, 64, 4, 1)),
    "64x16": (LaunchConfig(64, 16, 4, 1), LaunchConfig(16, 64, 4, 1), LaunchConfig(64, 16, 4, 1)),
}


@pytest.mark.parametrize("window", [(3, 2), (40, None), (None, 20), (-30, 50)], ids=str)
@pytest.mark.parametrize("tiles", list(TILES))
def test_window_edges_crossing_unequal_tiles(tiles, window):
    """Windows (ops' own form: None for no limit, any integers: (-30, 50) sees only keys 30 to 50 places past the
    diagonal) whose edges fall inside tiles, between them and past the sequence's end, on tiles of unequal sides."""
    fwd, dkdv, dq = TILES[tiles]
    q, k, v, dout = make_qkv(1, 70, 93, 2, 1, 32, DTYPES[0], seed=5)
    with override_configs({"portable.fwd": fwd, "portable.dkdv": dkdv, "portable.dq": dq}):
        out, lse = attn_fwd(q, k, v, 0.2, False, window=window, backend="portable")
        grads = attn_bwd(dout, q, k, v, out, lse, 0.2, False, window=window, backend="portable")
    check_against_reference(q, k, v, dout, 0.2, False, (out, lse, *grads), window=window)


def test_rows_outside_every_window_give_zeros_not_nan():
    """Sq > Sk with a window (0, 0): the first Sq - Sk rows' diagonal lies before the keys; they see nothing."""
    q, k, v, dout = make_qkv(1, 50, 20, 2, 2, 32, DTYPES[0], seed=2)
    out, lse = attn_fwd(q, k, v, 0.2, False, window=(0, 0))
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, 0.2, False, window=(0, 0))
    assert torch.all(out[:, :30] == 0) and torch.all(lse[:, :, :30] == float("-inf")) and torch.all(dq[:, :30] == 0)
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))


def test_key_band_combines_causal_and_the_window():
    assert key_band(False, (None, None), 5, 9) == (None, None)
    assert key_band(True, (None, None), 5, 9) == (None, 4)
    assert key_band(True, (3, 2), 5, 9) == (1, 4)  # causal caps the right side at 0
    assert key_band(False, (3, 2), 9, 5) == (-7, -2)
    assert key_band(False, (8, 8), 9, 5) == (None, None)  # sides that cut no pair are no limit
    assert key_band(False, (3, 3), 9, 5) == (-7, -1)
    assert key_band(False, (4, 4), 9, 5) == (None, 0)
    assert key_band(True, (sys.maxsize, sys.maxsize), 24, 8) == (None, -16)


def _fwd_bwd(q, k, v, dout, causal, window_size):
    """(out, lse, dq, dk, dv) of flash_attn_func."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = ringattn.flash_attn_func(q, k, v, causal=causal, window_size=window_size, return_lse=True)
    out.backward(dout)
    return out, lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(16, 16), (24, 8), (8, 24)], ids=str)
def test_windows_of_any_size_give_the_unlimited_sides_bits(seqlen_q, seqlen_k):
    """Regression: a side near 2**63 (sys.maxsize as "no limit") overflowed the kernels' band arithmetic (a wrong
    out silently, or an OverflowError naming no argument), and one past it failed the op schema's int64 check (on
    one rank of a ring); a side at least as long as the sequences is no limit."""
    q, k, v, dout = make_qkv(1, seqlen_q, seqlen_k, 2, 1, 32, DTYPES[0], seed=seqlen_q)
    huge = sys.maxsize
    for window, same_as in [((-1, huge), (-1, -1)), ((huge, -1), (-1, -1)), ((huge, huge), (-1, -1)),
                            ((4, huge), (4, -1)), ((huge, 3), (-1, 3)), ((2**40, 2**40), (-1, -1)),
                            ((2**64, 2), (-1, 2))]:  # fmt: skip
        for causal in (False, True):
            ours, want = (_fwd_bwd(q, k, v, dout, causal, w) for w in (window, same_as))
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ours, want, strict=True):
                assert torch.equal(a, b), (window, causal, name)


def _q():
    return torch.zeros(1, 8, 2, 32, device=DEVICE, dtype=DTYPES[0])


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(dropout_p=0.1), ValueError, "dropout_p must be 0.0: ringattn has no attention dropout, got 0.1"),
        (dict(causal="False"), TypeError, "causal must be a bool, got 'False'"),
        (dict(causal=torch.tensor([True, False])), TypeError, "causal must be a bool"),
        (dict(deterministic="yes"), TypeError, "deterministic must be a bool"),
        (dict(window_size=(-2, 0)), ValueError, "window_size's sides must be >= 0, or -1 for no limit"),
        (dict(window_size=4), TypeError, r"window_size must be a \(left, right\) pair of ints"),
        (dict(window_size=(1.5, 0)), TypeError, r"window_size must be a \(left, right\) pair of ints"),
        (dict(softcap=-1.0), ValueError, "softcap must be 0 .none. or a positive finite number, got -1.0"),
        (dict(softcap=float("inf")), ValueError, "softcap must be 0 .none. or a positive finite number"),
        (dict(softcap="30"), TypeError, "softcap must be a number"),
        (dict(softcap=10**400), ValueError, "softcap must be 0 .none. or a positive finite number"),  # past float
        (dict(softcap=torch.tensor(2.0, requires_grad=True)), TypeError, "softcap must not require grad"),
        # each in range, their ratio not: inf in float32 (a score of 0 capped NaN), or subnormal
        (dict(softmax_scale=1e20, softcap=1e-20), ValueError, r"softmax_scale / softcap must be from .*got 1e\+40"),
        (dict(softcap=1e38), ValueError, "softmax_scale / softcap must be from"),
        (dict(alibi_slopes=torch.ones(2)), ValueError, "alibi_slopes must be None"),
        (dict(return_attn_probs=True), ValueError, "return_attn_probs must be False.*return_lse=True"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_flash_attn_options_raise_clear_errors(kwargs, error, match):
    q = _q()
    with pytest.raises(error, match=match):
        ringattn.flash_attn_func(q, q, q, **kwargs)


def test_positional_flash_attn_call_is_read_as_flash_attn_reads_it():
    """flash-attn's order (q, k, v, dropout_p, softmax_scale, causal): flash_attn_func(q, k, v, 0.1, None, True)
    asks for dropout 0.1, and must raise instead of running with softmax_scale 0.1 and no mask; without dropout
    the positional softmax_scale and causal land where flash-attn puts them."""
    q, k, v, _ = make_qkv(1, 19, 19, 2, 2, 32, DTYPES[0], seed=4)
    with pytest.raises(ValueError, match="dropout_p"):
        ringattn.flash_attn_func(q, k, v, 0.1, None, True)
    positional = ringattn.flash_attn_func(q, k, v, 0.0, 0.3, True, (4, 0), 2.0)
    keywords = ringattn.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, window_size=(4, 0), softcap=2.0)
    assert torch.equal(positional, keywords)


def test_softcap_is_taken_as_softmax_scale_is():
    """softcap as a one-element tensor (or any number float() takes) gives the bits of the float, as softmax_scale
    does (a regression: a 0-d tensor or a numpy float was a TypeError for softcap alone)."""
    q, k, v, _ = make_qkv(1, 19, 19, 2, 2, 32, DTYPES[0], seed=6)
    expected = ringattn.flash_attn_func(q, k, v, softmax_scale=0.25, causal=True, softcap=2.0)
    given = ringattn.flash_attn_func(q, k, v, softmax_scale=torch.tensor(0.25), causal=True, softcap=torch.tensor(2.0))
    assert torch.equal(given, expected)


def test_keys_after_a_fully_masked_tile_keep_their_precision():
    """Regression: a row whose first key tiles were all masked (a window's lower edge) used to leave them with a
    running max of 0 instead of -inf, so its first visible keys' P came out of exp2 far from 1 and lost bits when
    rounded to v's dtype (bf16 out off by one ulp on the H200). With one visible key (window (0, 0)) the softmax
    is exactly 1: out must be v itself, bit for bit, in the 16-bit dtypes P is rounded to (fp32 keeps P unrounded;
    its out is within an ulp of v either way). q = -3 k makes each row's one score
    strongly negative, so that a stand-in max of 0 gave a P deep in fp16's subnormals; query tiles of 64 rows over
    key tiles of 16 (the GPU's are 128 x 64) give most rows masked tiles before their own key."""
    for dtype in DTYPES_16BIT:
        _, k, v, _ = make_qkv(1, 97, 97, 2, 2, 32, dtype, seed=8)
        with override_configs({"portable.fwd": LaunchConfig(64, 16, 4, 1)}):
            out = ringattn.flash_attn_func(-3 * k, k, v, window_size=(0, 0))
        assert torch.equal(out, v), f"{dtype}: max |out - v| {(out.float() - v.float()).abs().max():.3g}"
