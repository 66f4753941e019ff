"""flash_attn_varlen_func, the single-device packed form, against flash_attn_func's reference run sequence by
sequence (float64, the tolerance rule), and its argument checks."""

import pytest
import torch

import ringattn
from ringattn.testing import RESULTS, check_results
from tests.utils import DEVICE, DTYPES, make_qkv, reference_attention

DTYPE = DTYPES[0]


def _per_sequence_reference(q, k, v, dout, cu_q, cu_k, dtype, causal, **options):
    """reference_attention of each sequence alone, concatenated: (out, lse, dq, dk, dv) in the packed layout."""
    parts = []
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        parts.append(reference_attention(q[None, rows], k[None, keys], v[None, keys], dout[None, rows],
                                         q.shape[-1] ** -0.5, causal, dtype, **options))  # fmt: skip
    out, lse, dq, dk, dv = (torch.cat([p[i][0] for p in parts], dim=1 if i == 1 else 0) for i in range(5))
    return out, lse, dq, dk, dv


VARLEN_CASES = {  # (query lengths, key lengths, causal, window_size, softcap)
    "same-causal": ([5, 40, 1, 33], None, True, (-1, -1), 0.0),
    "same-window": ([37, 64, 9], None, True, (6, 0), 0.0),
    "same-softcap": ([20, 51], None, False, (-1, -1), 4.0),
    "cross-lengths": ([7, 30, 12], [19, 4, 45], False, (-1, -1), 0.0),
    # empty sequences (a boundary repeated, as static-shape packing makes them): flash-attn takes them
    "same-empty": ([5, 0, 40, 0, 0, 9], None, True, (-1, -1), 0.0),
    "cross-empty": ([7, 0, 12, 0], [19, 4, 6, 0], False, (-1, -1), 0.0),
}


@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen_matches_each_sequence_alone(case):
    """int64 boundaries for the sequences of different lengths, int32 for the others."""
    lengths_q, lengths_k, causal, window_size, softcap = VARLEN_CASES[case]
    cu_dtype = torch.int32 if lengths_k is None else torch.int64
    lengths_k = lengths_k or lengths_q
    cu_q = [0, *torch.tensor(lengths_q).cumsum(0).tolist()]
    cu_k = [0, *torch.tensor(lengths_k).cumsum(0).tolist()]
    q, k, v, dout = make_qkv(1, cu_q[-1], cu_k[-1], 4, 2, 32, DTYPE, seed=cu_q[-1])
    q, k, v, dout = (t[0].requires_grad_() if t is not dout else t[0] for t in (q, k, v, dout))
    out, lse = ringattn.flash_attn_varlen_func(
        q, k, v, torch.tensor(cu_q, dtype=cu_dtype, device=DEVICE), torch.tensor(cu_k, dtype=cu_dtype, device=DEVICE),
        max(lengths_q), max(lengths_k), causal=causal, window_size=window_size, softcap=softcap, return_lse=True,
    )  # fmt: skip
    out.backward(dout)
    window = tuple(None if side == -1 else side for side in window_size)
    options = dict(window=window, softcap=softcap)
    ref = _per_sequence_reference(q, k, v, dout, cu_q, cu_k, torch.float64, causal, **options)
    pt = _per_sequence_reference(q, k, v, dout, cu_q, cu_k, DTYPE, causal, **options)
    ours = (out, lse, q.grad, k.grad, v.grad)
    check_results(case, *(dict(zip(RESULTS, r, strict=True)) for r in (ours, pt, ref)))


def _packed():
    q = torch.zeros(10, 2, 32, device=DEVICE, dtype=DTYPE)
    return q, torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(causal=True, cu_seqlens_k=[0, 6, 10]), ValueError, "causal and window_size need cu_seqlens_q equal"),
        (dict(window_size=(2, 2), cu_seqlens_k=[0, 6, 10]), ValueError, "need cu_seqlens_q equal to cu_seqlens_k"),
        (dict(max_seqlen_q=5), ValueError, "max_seqlen_q must be at least the longest sequence of cu_seqlens_q, 6"),
        (dict(max_seqlen_k=6.0), TypeError, "max_seqlen_k must be an int"),
        (dict(cu_seqlens_q=[0, 4, 9]), ValueError, "cu_seqlens_q must end at the global length 10"),
        (dict(cu_seqlens_k=[0, 2, 5, 10]), ValueError, "the same number of sequences, got 2 and 3"),
        (dict(cu_seqlens_q=[0, 6, 4, 10], cu_seqlens_k=[0, 2, 5, 10]), ValueError, "cu_seqlens_q must be nondecreas"),
        (dict(q=torch.zeros(1, 10, 2, 32)), ValueError, r"q must be a 3-D tensor \(total_tokens, nheads, headdim\)"),
        (dict(dropout_p=0.5), ValueError, "dropout_p must be 0.0"),
    ],
    ids=["causal-cross", "window-cross", "max-short", "max-float", "cu-end", "cu-count", "cu-down", "q-4d", "dropout"],
)
def test_varlen_bad_arguments_raise(change, error, match):
    q, cu = _packed()
    args = dict(q=q, k=q, v=q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        if isinstance(change.get(name), list):
            change = dict(change, **{name: torch.tensor(change[name], dtype=torch.int32, device=DEVICE)})
    args.update(change)
    with pytest.raises(error, match=match):
        ringattn.flash_attn_varlen_func(**args)


def test_integers_as_flash_attn_takes_them():
    """flash-attn's C++ arguments take anything Python reads as an integer (operator.index): max_seqlen and window
    sides as integer 0-d tensors or objects with __index__ (numpy's integers) give the ints' bits; bools and floats
    stay TypeErrors."""
    q, k, v, _ = (t[0] for t in make_qkv(1, 16, 16, 2, 1, 32, DTYPE, seed=7))
    cu = torch.tensor([0, 5, 13, 16], dtype=torch.int32, device=DEVICE)
    want = ringattn.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, window_size=(3, 0))

    class Index:  # as numpy's integers: an int through __index__ alone
        def __init__(self, value):
            self.value = value

        def __index__(self):
            return self.value

    for integer in (Index, torch.tensor, lambda n: torch.tensor(n, dtype=torch.int32)):
        got = ringattn.flash_attn_varlen_func(q, k, v, cu, cu, integer(8), integer(8),
                                              window_size=(integer(3), integer(0)))  # fmt: skip
        assert torch.equal(got, want), integer
    for bad in (True, 8.0, torch.tensor(8.0), torch.tensor(True)):
        with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
            ringattn.flash_attn_varlen_func(q, k, v, cu, cu, bad, 8)
        with pytest.raises(TypeError, match=r"window_size must be a \(left, right\) pair of ints"):
            ringattn.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, window_size=(bad, 0))


def test_varlen_compiles_with_fullgraph_and_checks_values_at_every_call():
    """Regression: torch.compile(fullgraph=True) of flash_attn_varlen_func failed ("Could not guard on
    data-dependent expression"): the boundaries' values were read in Python. They are read in the custom op
    ringattn::varlen_doc_ids now, so the compiled call gives eager's bits, forward and backward, and a bad value
    (a sequence longer than max_seqlen) is still refused by the compiled call."""

    def call(q, k, v, cu, max_seqlen):
        return ringattn.flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True)

    q, k, v, dout = (t[0] for t in make_qkv(1, 16, 16, 2, 1, 32, DTYPE, seed=16))
    cu = torch.tensor([0, 5, 13, 16], dtype=torch.int32, device=DEVICE)
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (call, compiled):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, cu, 8)
        out.backward(dout)
        results.append((out, *(t.grad for t in leaves)))
    for name, eager, traced in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert torch.equal(eager, traced), name
    with pytest.raises(ValueError, match="max_seqlen_q must be at least the longest sequence of cu_seqlens_q, 8"):
        compiled(q, k, v, cu, 7)
