"""Cross-rank agreement: the header encoding and the messages as pure functions, and, on spawned gloo ranks, ranks
that call differently or refuse their input all raising the same clear error quickly, instead of hanging, aborting
the process or returning a wrong result."""

import functools
import gc
import os
import re
import time
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

import ringattn
from ringattn.ops.attn_ref import attn_fwd_ref
from ringattn.parallel import agreement, grid
from ringattn.parallel.agreement import (
    AGREEMENT_ENV,
    HEADER_LEN,
    MAX_DIMS,
    RingSignature,
    ShardSignature,
    UnshardSignature,
    agreement_mode,
    check_agreement,
    decode_fields,
    decode_header,
    describe_disagreement,
    describe_refusals,
    described_error,
    encode_header,
    is_described,
)
from ringattn.parallel.comm import CommunicationError
from ringattn.testing import check_close
from tests.distributed import run_ranks
from tests.utils import make_qkv

SIG = RingSignature(2, 37, 4, 2, 40, torch.float32, True, 0.15811388300841897, "zigzag", "q,k,v")
SHARD = UnshardSignature((2, 8, 3, 16), torch.bfloat16, 1, "contiguous")


def _header(call, fields=None, refusal=None):
    return decode_header(encode_header(call, fields, refusal))


@pytest.mark.parametrize(
    "call, sig",
    [
        ("ring_attn_func", SIG),
        ("ring_attn_func", SIG._replace(dtype=torch.bfloat16, causal=False, layout="contiguous", grads="none")),
        ("ring_attn_func", SIG._replace(softmax_scale=1e-300, dtype=torch.float16, batch=65535, seqlen_local=2**40)),
        ("ring_attn_func", SIG._replace(softmax_scale=float.fromhex("0x1.fffffffffffffp+1023"))),
        ("ring_attn_varlen_func", SIG._replace(documents=-(2**63) + 1, window_left=3, softcap=30.0, sinks=True)),
        ("shard", ShardSignature((), torch.int64, 0, "zigzag")),
        ("unshard", SHARD),
        ("unshard", SHARD._replace(shape=tuple(range(1, MAX_DIMS + 1)), dtype=torch.bool)),
    ],
    ids=["fp32-zigzag", "bf16-contiguous", "tiny-scale", "huge-scale", "varlen", "shard-0d", "unshard", "16-dims"],
)
def test_header_round_trips_exactly(call, sig):
    encoded = encode_header(call, sig)
    assert encoded.dtype == torch.int64 and encoded.shape == (HEADER_LEN,)
    for form in (encoded, encoded.tolist()):
        header = decode_header(form)
        assert header.call == call and header.refusal is None and header.message_bytes == 0
        decoded = decode_fields(type(sig), header.fields)
        assert decoded == sig and type(decoded) is type(sig)


def test_a_refusal_travels_without_fields():
    header = _header("hf attention mask", None, TypeError("q must be a torch.Tensor, got list"))
    assert header == ("hf attention mask", TypeError, 34, (0,) * len(header.fields), False)
    assert _header("shard", None, RuntimeError("x")).refusal is RuntimeError


def test_decode_rejects_what_is_not_a_header():
    good = encode_header("unshard", SHARD).tolist()
    with pytest.raises(ValueError, match="not a ringattn call header"):
        decode_header(good[:-1])
    with pytest.raises(ValueError, match="not a ringattn call header"):
        decode_header([0] + good[1:])
    with pytest.raises(ValueError, match="version 99"):
        decode_header(good[:1] + [99] + good[2:])
    with pytest.raises(ValueError, match="refusal 9"):
        decode_header(good[:6] + [9] + good[7:])


def test_encode_rejects_what_cannot_travel():
    with pytest.raises(ValueError, match=f"x_local.shape must have at most {MAX_DIMS} dims, got 17"):
        encode_header("unshard", SHARD._replace(shape=(1,) * 17))
    with pytest.raises(ValueError, match="the call's name must be at most 32 bytes"):
        encode_header("a" * 33)
    with pytest.raises(ValueError, match="layout must be at most 16 bytes"):
        encode_header("shard", SHARD._replace(layout="z" * 17))

    class Wide(NamedTuple):
        a: tuple[int, ...]
        b: tuple[int, ...]
        labels = {"a": "a", "b": "b"}

    with pytest.raises(ValueError, match=r"Wide takes 34 slots of a header's 32"):
        encode_header("wide", Wide((1,), (2,)))


def test_scales_that_differ_in_the_last_bit_disagree():
    other = SIG._replace(softmax_scale=float.fromhex((SIG.softmax_scale).hex()[:-1] + "0"))
    assert other.softmax_scale != SIG.softmax_scale
    headers = [_header("ring_attn_func", s) for s in (SIG, SIG, other)]
    message = describe_disagreement(headers, RingSignature)
    assert message is not None and "softmax_scale (rank 0: 0.15811388300841897" in message


def test_disagreement_message_names_each_field_and_every_rank_value():
    assert describe_disagreement([_header("ring_attn_func", SIG)] * 4, RingSignature) is None
    sigs = [SIG, SIG._replace(seqlen_local=38, causal=False), SIG._replace(dtype=torch.float16)]
    message = describe_disagreement([_header("ring_attn_func", s) for s in sigs], RingSignature)
    assert message.startswith("ring_attn_func: the ranks of the group disagree on ")
    assert "local sequence length (q.shape[1]) (rank 0: 37, rank 1: 38, rank 2: 37)" in message
    assert "dtype (rank 0: float32, rank 1: float32, rank 2: float16)" in message
    assert "causal (rank 0: True, rank 1: False, rank 2: True)" in message
    assert "batch size (" not in message and "layout (rank" not in message
    shards = [SHARD, SHARD._replace(shape=(2, 6, 3, 16), layout="zigzag")]
    message = describe_disagreement([_header("unshard", s) for s in shards], UnshardSignature)
    assert "x_local.shape (rank 0: (2, 8, 3, 16), rank 1: (2, 6, 3, 16))" in message
    assert "layout (rank 0: 'contiguous', rank 1: 'zigzag')" in message


def test_different_calls_are_named_with_each_rank():
    headers = [_header("ring_attn_func", SIG), _header("unshard", SHARD), _header("ring_attn_func", SIG)]
    message = describe_disagreement(headers, RingSignature)
    assert "make different collective calls (rank 0: ring_attn_func, rank 1: unshard, rank 2: ring_attn_func)" in (
        message
    )
    assert describe_disagreement([_header("hf attention mask")] * 2, None) is None


def test_refusals_name_each_refusing_rank_with_the_first_ones_type():
    errors = [None, TypeError("q must be float16"), ValueError("bad cu_seqlens"), TypeError("q must be float16")]
    headers = [_header("ring_attn_func", SIG if e is None else None, e) for e in errors]
    kind, message = describe_refusals(headers, ["" if e is None else str(e) for e in errors])
    assert kind is TypeError
    assert message == (
        "ring_attn_func refused on group ranks 1, 3 of 4: q must be float16; ring_attn_func refused on group rank 2 "
        "of 4: bad cu_seqlens (raised on every rank of the group)"
    )
    # on a group of a grid (global ranks 2, 3, 6, 7), each refusing rank's global rank too
    _, message = describe_refusals(headers, ["" if e is None else str(e) for e in errors], [2, 3, 6, 7])
    assert message.startswith("ring_attn_func refused on group ranks 1, 3 of 4 (global ranks 3, 7): q must be float16")
    assert "ring_attn_func refused on group rank 2 of 4 (global rank 6): bad cu_seqlens" in message


def test_a_refusal_shared_on_another_group_first_keeps_its_description():
    """A grid shares a refusal on its Ulysses group, then on its ring: the ring's description is not nested. The
    header says so (the error's mark from the exchange), not the text: a message of the user's own that reads
    like a description is described like any other."""
    shared = describe_refusals([_header("hf attention mask"), _header("hf attention mask", None, ValueError("w"))],
                               ["", "w"])[1]  # fmt: skip
    assert shared == "hf attention mask refused on group rank 1 of 2: w (raised on every rank of the group)"
    agreed = described_error(TypeError, shared)  # as an exchange raises it
    assert is_described(agreed) and not is_described(TypeError(shared))
    header = _header("hf attention mask", None, agreed)
    assert header.refusal is TypeError and header.described
    assert describe_refusals([header] * 2, [shared] * 2) == (TypeError, shared)
    look_alike = _header("hf attention mask", None, TypeError(shared))
    assert look_alike.refusal is TypeError and not look_alike.described
    kind, message = describe_refusals([look_alike, _header("hf attention mask")], [shared, ""])
    assert message == f"hf attention mask refused on group rank 0 of 2: {shared} (raised on every rank of the group)"


def test_agreement_mode_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(AGREEMENT_ENV, raising=False)
    assert agreement_mode() == "always"
    for mode in ("always", "off", " OFF "):
        monkeypatch.setenv(AGREEMENT_ENV, mode)
        assert agreement_mode() == mode.strip().lower()
    for mode in ("once", "sometimes"):  # "once" (a cache of validated calls) is gone: it could not be trusted
        monkeypatch.setenv(AGREEMENT_ENV, mode)
        with pytest.raises(ValueError, match=r"\$RINGATTN_AGREEMENT must be one of \('always', 'off'\)"):
            agreement_mode()


def _qkv(seqlen=8, heads_k=1, dtype=torch.float32, requires_grad=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seqlen, 2, 8, generator=gen).to(dtype).requires_grad_(requires_grad)
    k = torch.randn(1, seqlen, heads_k, 8, generator=gen).to(dtype).requires_grad_(requires_grad)
    return q, k, k.detach().clone().requires_grad_(requires_grad)


# (what differs, the keyword arguments of rank 1 (the others use the defaults), the expected text)
DISAGREEMENTS = [
    ("seqlen", dict(seqlen=10), "local sequence length (q.shape[1]) (rank 0: 8, rank 1: 10, rank 2: 8)"),
    ("kv-heads", dict(heads_k=2), "key/value heads (k.shape[2]) (rank 0: 1, rank 1: 2, rank 2: 1)"),
    ("dtype", dict(dtype=torch.float16), "dtype (rank 0: float32, rank 1: float16, rank 2: float32)"),
    ("causal", dict(causal=False), "causal (rank 0: True, rank 1: False, rank 2: True)"),
    ("scale", dict(softmax_scale=0.5), "softmax_scale (rank 0: 0.25, rank 1: 0.5, rank 2: 0.25)"),
    ("layout", dict(layout="contiguous"), "layout (rank 0: 'zigzag', rank 1: 'contiguous', rank 2: 'zigzag')"),
    (
        "grad",
        dict(requires_grad=False),
        "which of q, k, v and learnable_sink require grad (rank 0: 'q,k,v', rank 1: 'none', rank 2: 'q,k,v')",
    ),
]


def _call(
    seqlen=8, heads_k=1, dtype=torch.float32, causal=True, softmax_scale=0.25, layout="zigzag", requires_grad=True
):
    q, k, v = _qkv(seqlen, heads_k, dtype, requires_grad)
    return ringattn.ring_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, layout=layout)


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
    # one exchange every call by default, none with "off"
    exchanges = [_count_exchanges(_call), _count_exchanges(_call)]
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
        assert exchanges == [1, 1, 0]


# both ranks call with A, then with B, then `odd` calls with B while the others call with A
CHANGES = {
    "equal-bytes": (dict(seqlen=16, heads_k=1), dict(seqlen=8, heads_k=2)),  # K/V shards of 512 bytes each
    "unequal-bytes": (dict(seqlen=16, heads_k=1), dict(seqlen=8, heads_k=1)),
}


def _one_rank_changes_its_call(rank, world_size, change, odd):
    a, b = CHANGES[change]
    for kwargs in (a, b):  # every rank makes both calls: both are valid, and were cached as such before
        q, k, v = _qkv(**kwargs, requires_grad=False, seed=rank)
        ringattn.ring_attn_func(q, k, v, causal=True, layout="contiguous")
    q, k, v = _qkv(**(b if rank == odd else a), requires_grad=False, seed=rank)
    start = time.monotonic()
    with pytest.raises(ValueError, match="the ranks of the group disagree") as err:
        ringattn.ring_attn_func(q, k, v, causal=True, layout="contiguous")
    return str(err.value), time.monotonic() - start


@pytest.mark.parametrize(
    "change, world_size, odd", [("equal-bytes", 2, 1), ("unequal-bytes", 2, 1), ("equal-bytes", 4, 2)]
)
def test_a_rank_that_changes_its_call_alone_is_caught(change, world_size, odd):
    """Regression: under the default agreement mode (a cache of calls validated once), ranks that had all called
    with A and with B, then called with A and B at once, were not compared again. With K/V shards of equal byte
    size (S_local 16, Hkv 1 against S_local 8, Hkv 2) both ranks returned without an error, rank 1's output off by
    1.43 relative; with unequal sizes gloo aborted the process (SIGABRT). Now every call is compared: every rank,
    not only the odd rank's ring neighbours, raises the same ValueError at once."""
    results = run_ranks(_one_rank_changes_its_call, world_size, change, odd)
    assert len({message for message, _ in results}) == 1, results
    message = results[0][0]
    a, b = (kwargs["seqlen"] for kwargs in CHANGES[change])
    seqlens = ", ".join(f"rank {r}: {b if r == odd else a}" for r in range(world_size))
    assert f"local sequence length (q.shape[1]) ({seqlens})" in message
    assert ("key/value heads (k.shape[2])" in message) == (change == "equal-bytes")
    assert all(elapsed < 2.0 for _, elapsed in results), results


# rank 1's bad input (the others' is good): the error type, and the message its own checks give
REFUSALS = {
    "q-3d": (dict(q=torch.zeros(8, 2, 8)), ValueError, r"q must have 4 dimensions"),
    "int-dtype": (dict(dtype=torch.int32), TypeError, r"q must be float16, bfloat16 or float32, got torch.int32"),
    "dropout": (dict(dropout_p=0.1), ValueError, r"dropout_p"),
    "zigzag-odd": (dict(seqlen=7), ValueError, r"q.shape\[1\] = 7 must be divisible by 2 for layout 'zigzag'"),
}


def _a_rank_refuses(rank, world_size):
    results = {}
    for name, (bad, _, _) in REFUSALS.items():
        bad = dict(bad) if rank == 1 else {}
        q, k, v = _qkv(seqlen=bad.pop("seqlen", 8), dtype=bad.pop("dtype", torch.float32), requires_grad=False)
        q = bad.pop("q", q)
        start = time.monotonic()
        try:
            ringattn.ring_attn_func(q, k, v, causal=True, layout="zigzag", **bad)
        except (ValueError, TypeError) as err:
            results[name] = (type(err), str(err), time.monotonic() - start)
    # packed documents: rank 2's boundaries do not end at the global length
    cu_seqlens = torch.tensor([0, 5, 8 * world_size - (rank == 2)], dtype=torch.int32)
    q, k, v = (t[0] for t in _qkv(seqlen=8, requires_grad=False))
    with pytest.raises(ValueError) as err:
        ringattn.ring_attn_varlen_func(q, k, v, cu_seqlens, causal=True, layout="zigzag")
    results["varlen"] = (type(err.value), str(err.value), 0.0)
    return results


def test_a_rank_that_refuses_its_input_makes_every_rank_raise():
    """Regression: a ring call's local input checks (shapes, dtype, options, cu_seqlens) raised only on the rank
    whose input was bad; its peers went on into the exchange and waited until the P2P timeout (or gloo's
    "Connection closed by peer"). Now every rank raises the refusing rank's error type, naming that rank and its
    message, within a second (3 ranks: rank 0 is not the next rank of rank 2's)."""
    results = run_ranks(_a_rank_refuses, 3)
    for name, (_, kind, pattern) in REFUSALS.items():
        assert len({r[name][:2] for r in results}) == 1, f"{name}: ranks raised different errors {results}"
        got_kind, message, _ = results[0][name]
        assert got_kind is kind and message.startswith("ring_attn_func refused on group rank 1 of 3: "), message
        assert message.endswith("(raised on every rank of the group)")
        assert re.search(pattern, message), message
        assert all(r[name][2] < 1.0 for r in results), f"{name}: {[r[name][2] for r in results]}"
    assert len({r["varlen"] for r in results}) == 1
    assert results[0]["varlen"][1].startswith("ring_attn_varlen_func refused on group rank 2 of 3: cu_seqlens")


def _another_collective(rank, world_size):
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        if rank == 0:
            ringattn.ring_attn_func(*_qkv(), causal=True, layout="contiguous")
        else:
            ringattn.unshard(torch.zeros(1, 8, 2, 8))
    return str(err.value), time.monotonic() - start


def test_ranks_calling_different_collectives_all_raise():
    """Regression: one rank calling ring_attn_func while another called unshard aborted rank 0 (gloo), and rank 1's
    unshard returned a full tensor silently. Now both raise the same ValueError naming each rank's call."""
    results = run_ranks(_another_collective, 2)
    assert results[0][0] == results[1][0]
    assert "different collective calls (rank 0: ring_attn_func, rank 1: unshard)" in results[0][0]
    assert all(elapsed < 1.0 for _, elapsed in results)


def _backwards_in_another_order(rank, world_size, shapes, checkpointed=False):
    """Two ring calls agreed forward (checkpointed: each under torch.utils.checkpoint without reentry, so that its
    backward recomputes it first, a new call); rank 1 runs their backwards in the other order."""

    def call(seqlen):
        if not checkpointed:
            return _call(seqlen=seqlen)
        q, k, v = _qkv(seqlen, 1, torch.float32, True)
        attention = functools.partial(ringattn.ring_attn_func, softmax_scale=0.25, causal=True, layout="zigzag")
        return torch.utils.checkpoint.checkpoint(attention, q, k, v, use_reentrant=False)

    first, second = (call(n).sum() for n in shapes)
    losses = (first, second) if rank == 0 else (second, first)
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        for loss in losses:
            loss.backward()
    return str(err.value), time.monotonic() - start


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("shapes", [(8, 8), (8, 16)], ids=["same-shapes", "other-shapes"])
def test_backwards_in_another_order_on_one_rank_raise_on_every_rank(shapes, checkpointed):
    """Regression: the backward exchanged no header, so a rank differentiating the ring calls in another order ran
    each backward against its peers' other call: silently wrong gradients (off by 5 to 9 here) with equal shapes, a
    gloo abort with others. Now the backward agrees on which forward call it differentiates, numbered in the
    group's call order: the same ValueError on both ranks, within a second. Checkpointed (non-reentrant), the
    number is the first forward's, not the recomputation's (which the ranks agreed on by shapes alone): before,
    the recomputations of different calls paired up and the gradients were off by up to 3.9, without an error."""
    results = run_ranks(_backwards_in_another_order, 2, shapes, checkpointed)
    assert results[0][0] == results[1][0], results
    expected = "ring attention backward: the ranks of the group disagree on the forward call whose backward this"
    if checkpointed and shapes[0] != shapes[1]:  # the recomputations' own agreement sees it first
        expected = "ring_attn_func: the ranks of the group disagree on local sequence length (q.shape[1])"
    assert expected in results[0][0], results
    assert all(elapsed < 1.0 for _, elapsed in results)


def _exchange_on_a_twin(rank, world_size):
    group = dist.new_group([1, 0], sort_ranks=False)  # group rank 0 is global rank 1
    real_backend, created = dist.get_backend, []
    dist.get_backend = lambda g=None: "nccl" if g is group else real_backend(g)  # a group of no CPU tensors
    real_new_group = dist.new_group
    dist.new_group = lambda *a, **kw: created.append(kw) or real_new_group(*a, **kw)
    try:
        for _ in range(3):
            check_agreement("unshard", SHARD, group)
        with pytest.raises(ValueError) as err:
            check_agreement("unshard", SHARD._replace(dim=2 if rank == 1 else 1), group)
    finally:
        dist.get_backend, dist.new_group = real_backend, real_new_group
    channel, order = agreement.cpu_channel(group)
    return created, real_backend(channel), order, str(err.value)


def _twin_beside_a_subgroup(rank, world_size):
    dist.new_group([0, 1])  # every process makes it; ranks 0 and 1 then belong to one group more than rank 2
    world, real_backend = dist.group.WORLD, dist.get_backend
    dist.get_backend = lambda g=None: "nccl" if g is None or g is world else real_backend(g)
    try:
        start = time.monotonic()
        check_agreement("unshard", SHARD, None)
        return time.monotonic() - start
    finally:
        dist.get_backend = real_backend


def test_the_twin_is_made_where_ranks_belong_to_different_groups():
    """Regression: torch names the twin (a group made by its ranks alone) by its ranks and the number of groups the
    process belongs to; with a subgroup of ranks 0 and 1 in a world of 3, rank 2 named the world's twin otherwise
    and the first exchange of an NCCL job waited for ever. The ranks agree on that number first now."""
    assert all(elapsed < 30 for elapsed in run_ranks(_twin_beside_a_subgroup, 3, timeout=60))


def test_a_group_without_cpu_tensors_exchanges_on_a_gloo_twin():
    """A group whose backend carries no CPU tensors (NCCL) exchanges its headers on a gloo group of the same ranks,
    created once, with only those ranks taking part: no GPU work and no wait for the stream. The headers come back in
    the group's rank order even when it is not the global order."""
    results = run_ranks(_exchange_on_a_twin, 2)
    for created, backend, order, message in results:
        assert created == [dict(backend="gloo", use_local_synchronization=True)]
        assert backend == "gloo" and order == [1, 0]
        assert "dim (rank 0: 2, rank 1: 1)" in message


def _ring_in_a_second_world(rank, world_size, init_file):
    def call(group):
        q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
        ringattn.ring_attn_func(q, k, v, causal=True, layout="contiguous", group=group).sum().backward()

    solo = [dist.new_group([r]) for r in range(world_size)]  # a ring of one rank each, named alike on both ranks
    for _ in range(rank + 1):  # a different number of calls on each
        call(solo[rank])
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    ring = dist.new_group([0, 1])  # named as a solo group of the first world
    call(ring)
    return solo[rank].group_name, ring.group_name


def test_a_second_world_numbers_its_calls_afresh(tmp_path):
    """After destroy_process_group and a new world in the same processes, whose groups reuse the old names, a
    ring's backward agrees (regression: the calls were counted per group name across worlds, so each rank
    started from its old count and every backward was refused as another call's)."""
    (old_0, new), (old_1, _) = run_ranks(_ring_in_a_second_world, 2, str(tmp_path / "second-world"))
    assert new in (old_0, old_1)  # the case this is about: a name reused


def _a_group_a_step(rank, world_size):
    """Five steps, each on groups of its own (a ring, and a Ulysses group of a grid with no ring), destroyed after it;
    returns the groups the call numbering and the grid checks still hold afterwards."""
    for _ in range(5):
        ring, ulysses = dist.new_group([0, 1]), dist.new_group([0, 1])
        q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
        out = ringattn.ring_attn_func(q, k, v, causal=True, layout="zigzag", group=ring)
        out = out + ringattn.ulysses_ring_attn_func(q, k, v, causal=True, layout="zigzag", ulysses_group=ulysses)
        out.sum().backward()
        dist.destroy_process_group(ring)
        dist.destroy_process_group(ulysses)
        del ring, ulysses
    gc.collect()
    return len(agreement._calls), len(grid._checked)


def test_the_registries_of_destroyed_groups_go_with_them():
    """A group made and destroyed every step (say, rebuilt after an error) leaves nothing behind in the call
    numbering or the grid checks (regression: both were kept per world by group name, one entry a group forever)."""
    assert run_ranks(_a_group_a_step, 2) == [(0, 0), (0, 0)]


def _raise_in_hook(grad):
    raise RuntimeError("this rank's own hook raised")


def _fails_alone_and_goes_on(rank, world_size, failure):
    """Four training steps on data of their own (the same on every rank); at step 1 the last rank's backward raises
    in a hook of its own ("hook") or is left out ("skip"), and every rank catches what it raises and goes on. Per
    step: (out, fp32 and float64 reference outs) where the call returned, else the error's type and message."""
    steps = []
    for step in range(4):
        q, k, v, _ = make_qkv(1, 4 * world_size, 4 * world_size, 2, 1, 8, torch.float32, seed=step)
        rows = ringattn.shard_indices(q.shape[1], rank, world_size, "zigzag")
        q_local, k_local, v_local = (t[:, rows].clone().requires_grad_() for t in (q, k, v))
        try:
            out = ringattn.ring_attn_func(q_local, k_local, v_local, causal=True, layout="zigzag")
            refs = [attn_fwd_ref(*(t.to(dtype) for t in (q, k, v)), 8**-0.5, True)[0][:, rows] for dtype in
                    (torch.float32, torch.float64)]  # fmt: skip
            steps.append((out.detach(), *refs))
            if step == 1 and rank == world_size - 1:
                if failure == "skip":
                    continue
                out.register_hook(_raise_in_hook)
            out.sum().backward()
        except (ValueError, RuntimeError) as err:
            steps.append((type(err).__name__, str(err)))
    return steps


@pytest.mark.parametrize("failure, world_size", [("hook", 2), ("skip", 3)])
def test_ranks_out_of_step_raise_at_every_later_call(failure, world_size):
    """Regression: a rank whose backward raised alone (a hook of its own) or was left out, in a loop that caught the
    error and went on, left the ranks one call apart: the next exchange paired its backward with the others' next
    forward and raised, and every call after paired one rank's step with another's, returning outputs off by 1.1
    to 2.0 without an error. The exchange that sees the ranks make different calls now leaves the group unusable:
    every later call raises on every rank, and no call returns a wrong output."""
    results = run_ranks(_fails_alone_and_goes_on, world_size, failure)
    for rank, steps in enumerate(results):
        for step, result in enumerate(steps):
            if isinstance(result[0], torch.Tensor):
                check_close(f"rank {rank} step {step} out", *result)
        kind, message = steps[-1]
        assert kind == "CommunicationError" and "its ranks fell out of step at an earlier call" in message, steps[-1]
    # the exchange that saw it: the same ValueError on every rank
    seen = {result for steps in results for result in steps if result[0] == "ValueError"}
    assert len(seen) == 1 and "make different collective calls" in next(iter(seen))[1], seen


def _calls_after_a_timeout(rank, world_size):
    """Rank 1 leaves out rank 0's first call; rank 0 then calls again. Its errors, and how long each took."""
    q = torch.zeros(1, 8, 2, 8)
    errors = []
    if rank == 0:
        for _ in range(2):
            start = time.monotonic()
            with pytest.raises(CommunicationError) as err:
                ringattn.ring_attn_func(q, q, q, causal=True, layout="zigzag")
            errors.append((str(err.value), time.monotonic() - start))
    else:
        time.sleep(3)  # in the world until rank 0 is done (a barrier would pair with its pending exchange)
    return errors


def test_a_group_is_refused_after_an_exchange_on_it_failed(monkeypatch):
    """Regression: after an agreement exchange timed out, the next call exchanged again on the group, where what the
    peers had pending was unknown: it paired with their pending exchanges, which gloo answered with a header of
    another call ('not a ringattn call header'), data of the wrong size (SIGABRT), or a call of another step. Now the
    rank refuses the group at once (CommunicationError naming why), without communicating."""
    monkeypatch.setenv("RINGATTN_P2P_TIMEOUT_S", "1")
    (first, second), _ = run_ranks(_calls_after_a_timeout, 2, barrier=False)
    assert "did not complete within 1 s" in first[0]
    message, elapsed = second
    assert "the group cannot be used again on this rank: ring_attn_func's agreement check" in message, message
    assert "did not complete within 1 s at an earlier call. Exit, or destroy the group" in message, message
    assert elapsed < 0.5
