"""Cross-rank agreement: the signature encoding as pure functions, and ranks that disagree all
raising the same clear ValueError quickly instead of hanging (gloo, spawned ranks)."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import ringattn
from ringattn.parallel import agreement
from ringattn.parallel.agreement import (
    AGREEMENT_ENV,
    SIGNATURE_LEN,
    RingSignature,
    agreement_mode,
    decode_signature,
    describe_disagreement,
    encode_signature,
)
from tests.distributed import run_ranks

SIG = RingSignature(2, 37, 4, 2, 40, torch.float32, True, 0.15811388300841897, "zigzag", True)


@pytest.mark.parametrize(
    "sig",
    [
        SIG,
        SIG._replace(dtype=torch.bfloat16, causal=False, layout="contiguous", requires_grad=False),
        SIG._replace(softmax_scale=1e-300, dtype=torch.float16, batch=65535, seqlen_local=2**40),
        SIG._replace(softmax_scale=float.fromhex("0x1.fffffffffffffp+1023"), dtype=torch.float64),
    ],
    ids=["fp32-zigzag", "bf16-contiguous", "tiny-scale", "huge-scale"],
)
def test_signature_round_trips_exactly(sig):
    encoded = encode_signature(sig)
    assert encoded.dtype == torch.int64 and encoded.shape == (SIGNATURE_LEN,)
    assert decode_signature(encoded) == sig
    assert decode_signature(encoded.tolist()) == sig


def test_decode_rejects_what_is_not_a_signature():
    good = encode_signature(SIG).tolist()
    with pytest.raises(ValueError, match="not a ring signature"):
        decode_signature(good[:-1])
    with pytest.raises(ValueError, match="not a ring signature"):
        decode_signature([0] + good[1:])
    with pytest.raises(ValueError, match="version 99"):
        decode_signature(good[:1] + [99] + good[2:])
    with pytest.raises(ValueError, match="out of range"):
        decode_signature(good[:7] + [17] + good[8:])


def test_encode_rejects_unknown_dtype_and_layout():
    with pytest.raises(ValueError, match="dtype must be one of"):
        encode_signature(SIG._replace(dtype=torch.int32))
    with pytest.raises(ValueError, match="layout must be one of"):
        encode_signature(SIG._replace(layout="striped"))


def test_scales_that_differ_in_the_last_bit_disagree():
    other = SIG._replace(softmax_scale=float.fromhex((SIG.softmax_scale).hex()[:-1] + "0"))
    assert other.softmax_scale != SIG.softmax_scale
    message = describe_disagreement([SIG, SIG, other])
    assert message is not None and "softmax_scale (rank 0: 0.15811388300841897" in message


def test_disagreement_message_names_each_field_and_every_rank_value():
    assert describe_disagreement([SIG] * 4) is None
    sigs = [SIG, SIG._replace(seqlen_local=38, causal=False), SIG._replace(dtype=torch.float16)]
    message = describe_disagreement(sigs)
    assert "local sequence length (q.shape[1]) (rank 0: 37, rank 1: 38, rank 2: 37)" in message
    assert "dtype (rank 0: float32, rank 1: float32, rank 2: float16)" in message
    assert "causal (rank 0: True, rank 1: False, rank 2: True)" in message
    assert "batch size (" not in message and "layout (rank" not in message


def test_agreement_mode_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(AGREEMENT_ENV, raising=False)
    assert agreement_mode() == "once"
    for mode in ("once", "always", "off", " ALWAYS "):
        monkeypatch.setenv(AGREEMENT_ENV, mode)
        assert agreement_mode() == mode.strip().lower()
    monkeypatch.setenv(AGREEMENT_ENV, "sometimes")
    with pytest.raises(ValueError, match=r"\$RINGATTN_AGREEMENT must be one of"):
        agreement_mode()


# (what differs, the keyword arguments of rank 1 (the others use the defaults), the expected text)
DISAGREEMENTS = [
    ("seqlen", dict(seqlen=10), "local sequence length (q.shape[1]) (rank 0: 8, rank 1: 10, rank 2: 8)"),
    ("kv-heads", dict(heads_k=2), "key/value heads (k.shape[2]) (rank 0: 1, rank 1: 2, rank 2: 1)"),
    ("dtype", dict(dtype=torch.float16), "dtype (rank 0: float32, rank 1: float16, rank 2: float32)"),
    ("causal", dict(causal=False), "causal (rank 0: True, rank 1: False, rank 2: True)"),
    ("scale", dict(softmax_scale=0.5), "softmax_scale (rank 0: 0.25, rank 1: 0.5, rank 2: 0.25)"),
    ("layout", dict(layout="contiguous"), "layout (rank 0: 'zigzag', rank 1: 'contiguous', rank 2: 'zigzag')"),
    ("grad", dict(requires_grad=False), "whether q, k or v require grad (rank 0: True, rank 1: False, rank 2: True)"),
]


def _call(
    seqlen=8, heads_k=1, dtype=torch.float32, causal=True, softmax_scale=0.25, layout="zigzag", requires_grad=True
):
    q = torch.randn(1, seqlen, 2, 8, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(1, seqlen, heads_k, 8, dtype=dtype, requires_grad=requires_grad)
    return ringattn.ring_attn_func(q, k, k, softmax_scale=softmax_scale, causal=causal, layout=layout)


def _count_exchanges(fn):
    """Calls fn() and returns how many all_gathers it made."""
    calls = []
    real = dist.all_gather

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_gather = counting
    try:
        fn()
    finally:
        dist.all_gather = real
    return len(calls)


def _ranks_that_disagree(rank, world_size):
    messages, elapsed = {}, {}
    for name, kwargs, _ in DISAGREEMENTS:
        start = time.monotonic()
        with pytest.raises(ValueError, match="the ranks of the group disagree") as err:
            _call(**(kwargs if rank == 1 else {}))
        elapsed[name], messages[name] = time.monotonic() - start, str(err.value)
    # the exchange runs once per signature and group by default, every call with "always", never with "off"
    agreement.clear_agreement_cache()
    exchanges = [_count_exchanges(_call), _count_exchanges(_call)]
    os.environ[AGREEMENT_ENV] = "always"
    exchanges += [_count_exchanges(_call), _count_exchanges(_call)]
    os.environ[AGREEMENT_ENV] = "off"
    exchanges += [_count_exchanges(_call)]
    return messages, elapsed, exchanges


def test_ranks_that_disagree_all_raise_the_same_clear_error():
    """3 ranks, rank 1 differs in one thing at a time: every rank raises the same ValueError naming what
    differs with each rank's value, within a second; a mismatch never reaches the P2P ring."""
    results = run_ranks(_ranks_that_disagree, 3)
    for name, _, expected in DISAGREEMENTS:
        texts = {messages[name] for messages, _, _ in results}
        assert len(texts) == 1, f"{name}: ranks raised different errors {texts}"
        assert expected in texts.pop()
        for rank, (_, elapsed, _) in enumerate(results):
            assert elapsed[name] < 1.0, f"{name}: rank {rank} took {elapsed[name]:.2f} s to raise"
    for _, _, exchanges in results:
        assert exchanges == [1, 0, 1, 1, 0]
