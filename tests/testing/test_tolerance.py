"""ringattn.testing.reference: the chunked float64 / plain reference of the main job's check and of
launch/ring_error_growth.py equals the unchunked reference ops under autograd."""

import pytest
import torch

from ringattn.testing import RESULTS, check_close, check_results, max_abs_error, reference
from tests.utils import make_qkv, reference_attention

NAMES = ("out", "lse", "dq", "dk", "dv")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads_q, heads_k", [(4, 4), (4, 2), (3, 1)], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("seqlen", [1, 17], ids=lambda s: f"S{s}")
def test_reference_is_the_unchunked_reference(seqlen, heads_q, heads_k, causal):
    q, k, v, dout = make_qkv(2, seqlen, seqlen, heads_q, heads_k, 24, torch.float32, device=torch.device("cpu"))
    got = reference(q, k, v, dout, 24**-0.5, causal, torch.float64)
    want = reference_attention(q, k, v, dout, 24**-0.5, causal, torch.float64)
    for name, w in zip(NAMES, want, strict=True):
        assert got[name].dtype == torch.float64 and got[name].shape == w.shape, name
        torch.testing.assert_close(got[name], w, rtol=1e-12, atol=1e-12, msg=name)


def test_reference_rounds_to_the_input_dtype_and_keeps_lse_wide():
    q, k, v, dout = make_qkv(1, 33, 33, 2, 1, 16, torch.float32, device=torch.device("cpu"))
    got = reference(q, k, v, dout, 0.25, True, torch.float16)
    assert {name: got[name].dtype for name in NAMES} == dict.fromkeys(NAMES, torch.float16) | {"lse": torch.float32}


def test_check_results_judges_gradients_at_the_largest_and_names_the_tensor():
    """A gradient small against the others (here dq, zero in ref and plain) is allowed an error at the others'
    scale; beyond it, the failure names the call and the tensor."""
    ref = {name: torch.full((4,), 1e3 if name == "dv" else 0.0, dtype=torch.float64) for name in RESULTS}
    pt = {name: t.float() for name, t in ref.items()}
    ok = check_results("call", {"dq": torch.full((4,), 1e-3)}, pt, ref)
    assert set(ok) == {"dq"} and ok["dq"][0] <= ok["dq"][1]
    with pytest.raises(AssertionError, match="call dq"):
        check_results("call", {"dq": torch.full((4,), 1.0)}, pt, ref)
    with pytest.raises(AssertionError, match="call out"):  # out at its own magnitude (0): no such allowance
        check_results("call", {"out": torch.full((4,), 1e-3)}, pt, ref)


def test_non_finite_entries_and_shapes_are_judged_strictly():
    """Regressions: a NaN in the reference (and the plain result) made the allowed error inf, so anything passed;
    a NaN result where the reference is finite gave an error of NaN, not inf; a plain result of another shape
    broadcast into an inf allowance. Now the reference's NaN, inf and -inf must be matched, a non-finite result
    where it is finite is an inf error, and shapes must agree."""
    ref = torch.tensor([1.0, float("nan"), float("-inf")], dtype=torch.float64)
    assert max_abs_error(ref, ref) == 0.0
    assert max_abs_error(torch.tensor([float("nan"), float("nan"), float("-inf")]), ref) == float("inf")
    assert max_abs_error(torch.tensor([1.0, 0.0, float("-inf")]), ref) == float("inf")
    assert check_close("t", ref.float(), ref.float(), ref)[0] == 0.0
    with pytest.raises(AssertionError, match="t: max abs error inf"):
        check_close("t", torch.tensor([5.0, 5.0, 5.0]), ref.float(), ref)
    with pytest.raises(AssertionError, match=r"t: plain result's shape \(3, 1\) != reference shape \(3,\)"):
        check_close("t", ref.float(), ref.float()[:, None], ref)
    with pytest.raises(ValueError, match="max_abs_error needs x and ref of one shape"):
        max_abs_error(ref[:, None], ref)
