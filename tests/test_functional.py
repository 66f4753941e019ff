"""Bad input gets a clear error, raised before the ring's first P2P op: each case against ring_attn_func
(and flash_attn_func where it applies), in one process whose group looks like a ring of two ranks. Its
agreement exchange answers as if the other rank had made the same call (so the error is the one every
rank raises); every other collective or P2P call fails the test."""

import re
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

import ringattn
from ringattn.ops.dispatch import OVERRIDE_VARIABLE as KERNELS_ENV
from ringattn.ops.dispatch import kernel_override
from ringattn.parallel import documents
from ringattn.parallel.agreement import AGREEMENT_ENV
from ringattn.parallel.comm import P2P_TIMEOUT_ENV
from ringattn.parallel.documents import check_cu_seqlens, fingerprint
from tests.distributed import RING_BACKENDS, rank_device, run_ranks, skip_without_gpus
from tests.utils import DEVICE, DTYPES, make_qkv

DTYPE = DTYPES[0]
COMMUNICATION = ("all_gather_into_tensor", "all_reduce", "broadcast", "barrier")
COMMUNICATION += ("batch_isend_irecv", "send", "recv")  # the ring's P2POp(dist.isend, ...) must stay constructible


class Case(NamedTuple):
    id: str
    args: dict  # overrides: q, k, v as shapes, dtypes or devices; other keys are keyword arguments
    error: type
    match: str
    ring_only: bool = False
    env: dict | None = None


def _inputs(args: dict):
    """q (1, 8, 4, 32), k, v (1, 8, 2, 32) with the overrides of a Case ("q_shape", "k_dtype", "v_device",
    or "q_tensor": q itself); returns (q, k, v, the remaining keyword arguments)."""
    args, tensors = dict(args), {}
    for name, shape in (("q", (1, 8, 4, 32)), ("k", (1, 8, 2, 32)), ("v", (1, 8, 2, 32))):
        shape = args.pop(f"{name}_shape", shape)
        dtype, device = args.pop(f"{name}_dtype", DTYPE), args.pop(f"{name}_device", DEVICE)
        tensors[name] = args.pop(f"{name}_tensor", None)
        if tensors[name] is None:
            tensors[name] = torch.zeros(shape, dtype=dtype, device=device)
    return tensors["q"], tensors["k"], tensors["v"], args


OTHER_DTYPE = torch.float16 if DTYPE != torch.float16 else torch.float32
CASES = [
    Case("q-not-tensor", dict(q_tensor=[[0.0]]), TypeError, "q must be a torch.Tensor, got list"),
    Case("k-sparse", dict(k_tensor=torch.zeros(1, 8, 2, 32).to_sparse()), TypeError,
         "k must be a dense \\(strided\\) tensor, got layout torch.sparse_coo"),
    Case("q-3d", dict(q_shape=(8, 4, 32)), ValueError, r"q must have 4 dimensions .* got shape \(8, 4, 32\)"),
    Case("k-5d", dict(k_shape=(1, 8, 2, 32, 1)), ValueError, "k must have 4 dimensions"),
    Case("q-int", dict(q_dtype=torch.int32), TypeError, "q must be float16, bfloat16 or float32, got torch.int32"),
    Case("v-float64", dict(v_dtype=torch.float64), TypeError, "v must be float16, bfloat16 or float32"),
    Case("dtypes-differ", dict(k_dtype=OTHER_DTYPE, v_dtype=OTHER_DTYPE), TypeError, "q, k and v must share one dtype"),
    Case("devices-differ", dict(k_device="meta"), ValueError, "q, k and v must be on one device, got q .*, k meta"),
    Case("head-dim-36", dict(q_shape=(1, 8, 4, 36), k_shape=(1, 8, 2, 36), v_shape=(1, 8, 2, 36)), ValueError,
         "head dim must be a multiple of 8 from 8 to 256, got 36"),
    Case("head-dim-264", dict(q_shape=(1, 8, 4, 264), k_shape=(1, 8, 2, 264), v_shape=(1, 8, 2, 264)), ValueError,
         "head dim must be a multiple of 8 from 8 to 256, got 264"),
    Case("heads-not-divisible", dict(q_shape=(1, 8, 3, 32)), ValueError,
         "q's head count 3 must be divisible by k/v's head count 2"),
    Case("batch-mismatch", dict(k_shape=(2, 8, 2, 32), v_shape=(2, 8, 2, 32)), ValueError,
         "k and v must have q's batch size 1, got 2"),
    Case("dim-mismatch", dict(q_shape=(1, 8, 4, 64)), ValueError, "k and v must have q's head dim 64, got 32"),
    Case("kv-heads-mismatch", dict(v_shape=(1, 8, 1, 32)), ValueError, "k and v must have the same shape"),
    Case("v-head-dim", dict(v_shape=(1, 8, 2, 16)), ValueError,
         r"v must have k's head dim 32, got 16 \(a value head dim other than the query and key head dim is not"),
    Case("empty-q", dict(q_shape=(1, 0, 4, 32)), ValueError, "sequence lengths must be positive, got q 0"),
    Case("empty-kv", dict(k_shape=(1, 0, 2, 32), v_shape=(1, 0, 2, 32)), ValueError,
         "sequence lengths must be positive, got q 8, k/v 0"),
    Case("scale-negative", dict(softmax_scale=-1.0), ValueError, "softmax_scale must be a positive finite number"),
    Case("scale-nan", dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be a positive finite number"),
    Case("scale-string", dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a number or None, got str"),
    Case("scale-huge-int", dict(softmax_scale=10**400), ValueError, "softmax_scale must be a positive finite number"),
    Case("scale-over-softcap", dict(softmax_scale=1e20, softcap=1e-20), ValueError,
         "softmax_scale / softcap must be from"),
    Case("scale-requires-grad", dict(softmax_scale=torch.tensor(0.3, requires_grad=True)), TypeError,
         "softmax_scale must not require grad: ringattn computes no gradient for it"),
    Case("ring-q-kv-lengths", dict(k_shape=(1, 4, 2, 32), v_shape=(1, 4, 2, 32)), ValueError,
         "q, k and v must hold the same local sequence length in a ring, got q 8, k/v 4", ring_only=True),
    Case("ring-layout", dict(layout="striped"), ValueError, "layout must be one of", ring_only=True),
    Case("ring-zigzag-odd", dict(q_shape=(1, 7, 4, 32), k_shape=(1, 7, 2, 32), v_shape=(1, 7, 2, 32), layout="zigzag"),
         ValueError, r"q.shape\[1\] = 7 must be divisible by 2 for layout 'zigzag'", ring_only=True),
    Case("ring-group-type", dict(group="world"), TypeError,
         "group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, got str", ring_only=True),
    Case("ring-agreement-env", dict(), ValueError, r"\$RINGATTN_AGREEMENT must be one of", ring_only=True,
         env={AGREEMENT_ENV: "sometimes"}),
    Case("ring-timeout-env", dict(), ValueError, r"\$RINGATTN_P2P_TIMEOUT_S must be a number of seconds",
         ring_only=True, env={P2P_TIMEOUT_ENV: "soon"}),
    Case("kernels-env", dict(), ValueError, r"\$RINGATTN_KERNELS must be one of auto, portable \(or unset\), got 'on'",
         env={KERNELS_ENV: "on"}),
]  # fmt: skip
if DEVICE.type == "cpu":
    CASES += [
        Case("bf16-interpreter", dict(q_dtype=torch.bfloat16, k_dtype=torch.bfloat16, v_dtype=torch.bfloat16),
             TypeError, "bfloat16 is not supported by the Triton interpreter"),
        Case("ring-cpu-on-nccl", dict(backend="nccl"), ValueError, "the group's backend is nccl", ring_only=True),
    ]  # fmt: skip
else:
    CASES.append(Case("ring-cuda-on-gloo", dict(backend="gloo"), ValueError, "cannot carry them; use nccl", True))


class _Done:
    def wait(self, timeout=None) -> bool:
        return True


def _as_if_both_ranks_called_alike(outputs, tensor, group=None, async_op=False):
    """all_gather, the agreement exchange, of a ring of two whose other rank made this rank's call."""
    for out in outputs:
        out.copy_(tensor)
    return _Done() if async_op else None


@pytest.fixture
def ring_of_two_without_communication(tmp_path, monkeypatch):
    """A one-process gloo group that reports a world size of 2, whose agreement exchange answers as if
    the other rank had made the same call, and with every other collective and P2P call replaced by
    one that fails the test: an error raised after the ring's communication started shows up as that
    failure instead of the expected error. On a GPU machine (CUDA tensors) it reports the nccl
    backend, which can carry them."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with monkeypatch.context() as patch:
            if DEVICE.type == "cuda":
                patch.setattr(dist, "get_backend", lambda group=None: "nccl")

            def communication(*args, **kwargs):
                raise AssertionError("communication started before the inputs were validated")

            for name in COMMUNICATION:
                patch.setattr(dist, name, communication)
            patch.setattr(dist, "all_gather", _as_if_both_ranks_called_alike)
            patch.setattr(dist, "get_world_size", lambda group=None: 2)
            yield patch
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_raises_a_clear_error_before_communication(case, ring_of_two_without_communication):
    patch = ring_of_two_without_communication
    for name, value in (case.env or {}).items():
        patch.setenv(name, value)
    kernel_override.cache_clear()  # read once per process: this case's (a bad value is never cached)
    args = dict(case.args)
    if "backend" in args:
        backend = args.pop("backend")
        patch.setattr(dist, "get_backend", lambda group=None: backend)
    q, k, v, kwargs = _inputs(args)
    with pytest.raises(case.error, match=case.match):
        ringattn.ring_attn_func(q, k, v, **{"layout": "contiguous", **kwargs})
    if not case.ring_only:
        with pytest.raises(case.error, match=case.match):
            ringattn.flash_attn_func(q, k, v, **kwargs)


def test_good_input_reaches_the_ring(ring_of_two_without_communication):
    """The fixture's guard works: valid inputs get past every check and the agreement into the ring's first P2P
    (whose failure RingComm reports as a RuntimeError naming the backend's error)."""
    q, k, v, _ = _inputs({})
    with pytest.raises(RuntimeError, match="Backend error: communication started before the inputs were validated"):
        ringattn.ring_attn_func(q, k, v, layout="contiguous")


def test_a_varlen_ring_call_reads_its_boundaries_once(ring_of_two_without_communication):
    """The ring's forward takes cu_seqlens' fingerprint once (each read the boundaries to the host: a sync where
    they are on the GPU): the same digest signs the call and keys the cache of the ranks' documents. Then the call
    reaches the ring's first P2P."""
    digests = []

    def counted(cu_seqlens):
        digests.append(fingerprint(cu_seqlens))
        return digests[-1]

    ring_of_two_without_communication.setattr(documents, "fingerprint", counted)
    q, k, v, _ = _inputs(dict(q_shape=(8, 4, 32), k_shape=(8, 2, 32), v_shape=(8, 2, 32)))
    cu_seqlens = torch.tensor([0, 5, 16], dtype=torch.int32, device=DEVICE)  # two documents over 2 x 8 tokens
    with pytest.raises(RuntimeError, match="communication started before the inputs were validated"):
        ringattn.ring_attn_varlen_func(q, k, v, cu_seqlens, layout="contiguous")
    assert len(digests) == 1


@pytest.mark.parametrize("causal", ["False", "no", torch.tensor([True, False])], ids=["False", "no", "tensor-2"])
def test_causal_that_is_not_a_bool_raises_naming_causal(causal, ring_of_two_without_communication):
    """Regression: causal="False" or "no" was read as bool(causal), i.e. causal attention, by flash_attn_func,
    ring_attn_func and RingAttention; a 2-element tensor gave torch's ambiguous-truth error, naming no argument."""
    q, k, v, _ = _inputs({})
    match = re.escape(f"causal must be a bool, got {causal!r}")
    with pytest.raises(TypeError, match=match):
        ringattn.flash_attn_func(q, k, v, causal=causal)
    with pytest.raises(TypeError, match=match):
        ringattn.ring_attn_func(q, k, v, causal=causal, layout="contiguous")
    with pytest.raises(TypeError, match=match):
        ringattn.nn.RingAttention(causal=causal, layout="contiguous")


def test_numpy_bools_are_bools():
    """Regression: numpy 2 names its bool type bool, not bool_, and causal=np.True_ was refused as 'causal must be
    a bool, got np.True_ (bool)'; numpy's bools are taken as bools, as the docs say."""
    np = pytest.importorskip("numpy")
    q, k, v, _ = _inputs({})
    for flag in (np.True_, np.False_):
        out = ringattn.flash_attn_func(q, k, v, causal=flag)
        assert torch.equal(out, ringattn.flash_attn_func(q, k, v, causal=bool(flag)))


def test_return_lse_that_is_not_a_bool_raises_naming_it(ring_of_two_without_communication):
    """Regression: return_lse="False" (or [0]) returned (out, lse), read as bool(return_lse), in every public
    function."""
    q, k, v, _ = _inputs({})
    cu = torch.tensor([0, 8, 16], dtype=torch.int32, device=DEVICE)
    calls = (
        lambda flag: ringattn.flash_attn_func(q, k, v, return_lse=flag),
        lambda flag: ringattn.flash_attn_varlen_func(q[0], k[0], v[0], cu[:2], cu[:2], 8, 8, return_lse=flag),
        lambda flag: ringattn.ring_attn_func(q, k, v, layout="contiguous", return_lse=flag),
        lambda flag: ringattn.ring_attn_varlen_func(q[0], k[0], v[0], cu, layout="contiguous", return_lse=flag),
    )
    for call in calls:
        for flag in ("False", [0]):
            with pytest.raises(TypeError, match=re.escape(f"return_lse must be a bool, got {flag!r}")):
                call(flag)


def test_positional_varlen_call_cannot_set_softmax_scale():
    """Regression: ring_attn_varlen_func(q, k, v, cu_seqlens, 44), a flash-attn varlen call's max_seqlen in
    position 5, took 44 as the softmax scale; every argument after cu_seqlens is keyword-only."""
    q = torch.zeros(8, 2, 32, device=DEVICE, dtype=DTYPE)
    cu_seqlens = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="takes 4 positional arguments but 5 positional arguments"):
        ringattn.ring_attn_varlen_func(q, q, q, cu_seqlens, 44, layout="zigzag")


def test_the_layout_has_no_default():
    """Regression: ringattn.shard defaulted to zigzag shards, ring_attn_func and RingAttention to the contiguous
    layout and ring_attn_varlen_func to zigzag, so a causal call with every default ran on shards of the other layout:
    wrong by 1.08 on 2 ranks, without an error. Every attention call over shards now names its layout."""
    q = torch.zeros(1, 8, 2, 32, device=DEVICE, dtype=DTYPE)
    cu_seqlens = torch.tensor([0, 3, 16], dtype=torch.int32, device=DEVICE)
    calls = {
        "ring_attn_func": lambda: ringattn.ring_attn_func(q, q, q, causal=True),
        "ring_attn_varlen_func": lambda: ringattn.ring_attn_varlen_func(q[0], q[0], q[0], cu_seqlens),
        "ulysses_ring_attn_func": lambda: ringattn.ulysses_ring_attn_func(q, q, q, causal=True),
        "ulysses_ring_attn_varlen_func": lambda: ringattn.ulysses_ring_attn_varlen_func(q[0], q[0], q[0], cu_seqlens),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=rf"{name}\(\) missing 1 required keyword-only argument: 'layout'"):
            call()
    with pytest.raises(TypeError, match=r"RingAttention needs sp= \(the SequenceParallel that shards its inputs\) or"):
        ringattn.nn.RingAttention(causal=True)  # the layout, or the SequenceParallel that gives it


@pytest.mark.parametrize(
    "name,value", [("softmax_scale", 1e39), ("softmax_scale", 3e38), ("softmax_scale", 1e-46), ("softcap", 1e39),
                   ("softcap", 1e-39)],
)  # fmt: skip
def test_scale_and_softcap_outside_float32_raise_naming_them(name, value, ring_of_two_without_communication):
    """Regression: softmax_scale = 1e39 passed validation (finite in float64) and gave an all-NaN output, the kernels
    taking it in float32; so did scales and softcaps that float32 (times log2(e)) turns into inf or 0."""
    q, k, v, _ = _inputs({})
    expected = "from 1.18e-38 to 2.36e+38: the kernels take it in float32, times log2(e)"
    match = re.escape(f"{name} must be {expected}; got {value}")
    with pytest.raises(ValueError, match=match):
        ringattn.flash_attn_func(q, k, v, **{name: value})
    with pytest.raises(ValueError, match=match):
        ringattn.ring_attn_func(q, k, v, layout="contiguous", **{name: value})
    with pytest.raises(ValueError, match=match):
        ringattn.nn.RingAttention(layout="contiguous", **{name: value})


DOUBLE_BACKWARD = "ringattn's attention is differentiable once: double backward"


def _double_backward_raises(rank, world_size, backend, dtype):
    q, k, v, _ = make_qkv(1, 8, 8, 2, 2, 16, dtype, device=rank_device(rank, backend), seed=rank)
    q.requires_grad_()
    out = ringattn.ring_attn_func(q, k, v, causal=True, layout="contiguous")
    with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)
    return True


def test_torch_deterministic_mode_takes_the_deterministic_backward(monkeypatch):
    """Under torch.use_deterministic_algorithms(True) the backward is planned as deterministic=True's (one writer
    per gradient row), as PyTorch's own attention backward honours the mode (regression: it was ignored, and on
    Hopper the Gluon backward's atomic dQ ran)."""
    from ringattn.ops import dispatch

    seen = []
    plan = dispatch.bwd_launches
    monkeypatch.setattr(
        dispatch, "bwd_launches", lambda call, *args: seen.append(call.deterministic) or plan(call, *args)
    )
    q, k, v, dout = make_qkv(1, 16, 16, 2, 1, 16, DTYPES[0], seed=5)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        for mode in (False, True):
            torch.use_deterministic_algorithms(mode)
            q_g = q.detach().requires_grad_()
            ringattn.flash_attn_func(q_g, k, v, causal=True).backward(dout)
    finally:
        torch.use_deterministic_algorithms(was)
    assert seen == [False, True]


def test_double_backward_raises_a_clear_error():
    """Regression: a double backward through flash_attn_func gave torch's "no autograd formula was registered" for
    ringattn::attn_bwd, naming nothing of ringattn (through the ring: "does not have a grad_fn")."""
    q, k, v, _ = make_qkv(1, 8, 8, 2, 2, 16, DTYPE)
    q.requires_grad_()
    out = ringattn.flash_attn_func(q, k, v, causal=True)
    with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)


@pytest.mark.parametrize("backend,dtype", RING_BACKENDS[:2])
def test_double_backward_through_the_ring_raises_on_every_rank(backend, dtype):
    """Regression: a double backward through the ring gave torch's "does not have a grad_fn"; now every rank
    raises the same clear error, before any communication."""
    skip_without_gpus(backend, 2)
    assert run_ranks(_double_backward_raises, 2, backend, dtype, backend=backend) == [True, True]


def test_meta_tensors_give_meta_outputs_and_meta_boundaries_raise_naming_them():
    """Regression: cu_seqlens on the meta device gave torch's "Cannot copy out of meta tensor", naming no argument;
    flash_attn_func on meta tensors gave meta outputs where the docs promised a RuntimeError (they are what its
    custom ops' fake implementations give torch.compile, and the docs now say so)."""
    q = torch.zeros(2, 8, 4, 16, device="meta", requires_grad=True)
    k = torch.zeros(2, 12, 2, 16, device="meta", requires_grad=True)
    out, lse = ringattn.flash_attn_func(q, k, k, causal=True, return_lse=True)
    out.sum().backward()
    assert (out.device.type, out.shape, lse.shape, lse.dtype) == ("meta", q.shape, (2, 4, 8), torch.float32)
    assert (q.grad.device.type, q.grad.shape, k.grad.shape) == ("meta", q.shape, k.shape)

    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device="meta")
    meta_boundaries = "must hold values (they are read on the host), got a tensor on the meta device"
    with pytest.raises(ValueError, match=re.escape(f"cu_seqlens_q {meta_boundaries}")):
        ringattn.flash_attn_varlen_func(q[0], k[0, :8], k[0, :8], cu, cu, 5, 5)
    with pytest.raises(ValueError, match=re.escape(f"cu_seqlens {meta_boundaries}")):
        check_cu_seqlens(cu, 8)


def test_flash_attn_func_compiles_with_fullgraph_one_tensor_as_k_and_v_and_sinks():
    """Regression: torch.compile(fullgraph=True) of flash_attn_func refused one tensor passed as both k and v
    ("autograd.Function.apply: duplicate tensor input"); the single-device call is the custom op
    ringattn::flash_attn_fwd now, so the compiled call gives eager's bits: out, and the gradients of q, of the tensor
    as k and v, and of the sinks."""

    def call(q, kv, sink):
        return ringattn.flash_attn_func(q, kv, kv, causal=True, learnable_sink=sink)

    q, kv, _, dout = make_qkv(1, 16, 16, 4, 2, 32, DTYPES[0], seed=17)
    sink = torch.tensor([-1.0, 0.5, 2.0, 4.0], device=DEVICE)
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (call, compiled):
        leaves = [t.detach().requires_grad_() for t in (q, kv, sink)]
        out = fn(*leaves)
        out.backward(dout)
        results.append((out, *(t.grad for t in leaves)))
    for name, eager, traced in zip(("out", "dq", "dkv", "dsink"), *results, strict=True):
        assert torch.equal(eager, traced), name


def test_flash_attn_fwd_op_passes_opcheck():
    """ringattn::flash_attn_fwd's schema, fake implementation and autograd registration (fp16 with sinks that need
    their gradient: the op also returns the fp32 out; without sinks, where it returns an empty fp32 state (a
    regression: the real op's was fp16); and packed documents), as torch.library.opcheck checks them."""
    from ringattn.functional import flash_attn_fwd_op

    q, k, v, _ = make_qkv(1, 16, 16, 4, 2, 16, torch.float16, seed=3)
    q, k, v, sink = (t.requires_grad_() for t in (q, k, v, torch.tensor([-1.0, 0.5, 2.0, 4.0], device=DEVICE)))
    ids = torch.tensor([[0] * 5 + [1] * 11], dtype=torch.int32, device=DEVICE)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    for doc_ids, learnable_sink in ((None, sink), (ids, sink), (None, None)):
        args = (q, k, v, learnable_sink, 0.25, True, None, None, 0.0, False, doc_ids, doc_ids)
        torch.library.opcheck(flash_attn_fwd_op, args, test_utils=checks)


def test_forward_mode_ad_is_refused_not_a_zero_derivative(ring_of_two_without_communication):
    """Regression: torch.func.jvp through the attention functions returned a tangent of exactly 0 (the custom ops
    drop tangents), torch.autograd.forward_ad none; a tangent on q, k, v or the sink is refused now, in the ring
    before any communication (so on every rank alike)."""
    from torch.autograd import forward_ad

    q, k, v, dout = make_qkv(1, 8, 8, 4, 2, 32, DTYPE, seed=3)
    sink = torch.zeros(4, device=DEVICE)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    calls = {  # q, k, v, sink -> out
        "flash_attn_func": lambda q, k, v, sink: ringattn.flash_attn_func(q, k, v, learnable_sink=sink),
        "flash_attn_varlen_func": lambda q, k, v, sink: ringattn.flash_attn_varlen_func(
            q[0], k[0], v[0], cu, cu, 5, 5, learnable_sink=sink
        ),
        "ring_attn_func": lambda q, k, v, sink: ringattn.ring_attn_func(
            q, k, v, layout="contiguous", learnable_sink=sink
        ),
    }
    match = "carries a forward-mode AD tangent"
    for call in calls.values():
        with pytest.raises(NotImplementedError, match=f"q {match}"):
            torch.func.jvp(lambda q: call(q, k, v, None), (q,), (dout,))  # noqa: B023 (called at once)
        with forward_ad.dual_level():
            for i, arg in enumerate(("k", "v", "learnable_sink")):
                args = [q, k, v, sink]
                args[i + 1] = forward_ad.make_dual(args[i + 1], torch.ones_like(args[i + 1]))
                with pytest.raises(NotImplementedError, match=f"{arg} {match}"):
                    call(*args)
    # vmap, which carries no tangent, still runs: each batch row as its own call
    rows = torch.func.vmap(lambda q: ringattn.flash_attn_func(q[None], k[0:1], v[0:1])[0])(q.expand(2, -1, -1, -1))
    assert torch.equal(rows[0], ringattn.flash_attn_func(q, k, v)[0])
