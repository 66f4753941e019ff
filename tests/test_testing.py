"""ringattn.testing.reference: the chunked float64 / plain reference of the main job's check and of
launch/ring_error_growth.py equals the unchunked reference ops under autograd."""

import pytest
import torch

from ringattn.testing import reference
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
