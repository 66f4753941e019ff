"""The dispatch (ops/dispatch.py): capabilities by feature test, the one override, the backends' tables, configs.

Launches are planned from CPU tensors for a Hopper target (Target((9, 0))), as launch/tools/kernel_resources.py
plans them, so every choice is checked here without a GPU; nothing is run.
"""

import inspect

import pytest
import torch
import triton
import triton.language as tl

from ringattn.ops import (
    BwdCall,
    FinalRows,
    FwdCall,
    LaunchConfig,
    Target,
    attn_fwd,
    bwd_launches,
    dispatch,
    fwd_launch,
    launch_config,
    override_configs,
    portable,
    sm90,
)

HOPPER, AMPERE, BLACKWELL, INTERPRETER = Target((9, 0)), Target((8, 0)), Target((10, 0)), Target(None)
HOPPER_TRITON = dispatch.capabilities() == dispatch.Capabilities(gluon_hopper=True, split_kernels=True)
needs_hopper_triton = pytest.mark.skipif(not HOPPER_TRITON, reason=f"triton {triton.__version__} lacks the features")


@pytest.fixture
def no_override(monkeypatch):
    monkeypatch.delenv(dispatch.OVERRIDE_VARIABLE, raising=False)
    dispatch.kernel_override.cache_clear()
    yield
    dispatch.kernel_override.cache_clear()


def _tensors(seqlen_q=64, seqlen_k=64, heads=(2, 2), head_dim=128, dtype=torch.bfloat16):
    q, dout = (torch.randn(1, seqlen_q, heads[0], head_dim, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, seqlen_k, heads[1], head_dim, dtype=dtype) for _ in range(2))
    return q, k, v, dout


def _fwd(q, k, v, out_dtype=None, merge_state=False, causal=False, **kwargs):
    out = torch.empty(q.shape, dtype=out_dtype or q.dtype)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float64)
    return FwdCall(q, k, v, 0.125, causal, out, lse, merge_state=merge_state, **kwargs)


def _bwd(q, k, v, dout, grads_dtype=None, causal=False, **kwargs):
    grads = [torch.empty(t.shape, dtype=grads_dtype or t.dtype) for t in (q, k, v)]
    stats = torch.empty(3, q.shape[0], q.shape[2], q.shape[1])
    return BwdCall(dout, q, k, v, stats, *grads, 0.125, causal, **kwargs)


def _fwd_name(call, backend="sm90", target=HOPPER):
    return fwd_launch(call, backend, target).name


def _bwd_names(call, backend="sm90", target=HOPPER):
    return tuple(launch.name for launch in bwd_launches(call, backend, target))


def test_capabilities_are_features_not_versions(monkeypatch):
    """A newer (or any) version number changes nothing; a Gluon whose warp_specialize takes the partitions another
    way, or a triton without in-kernel descriptors, loses the features."""
    found = dispatch.detect_capabilities()
    for version in ("3.10.0", "4.0.0", "3.6.0"):
        monkeypatch.setattr(triton, "__version__", version)
        assert dispatch.detect_capabilities() == found
    from triton.experimental.gluon import language as gl

    def old_style(default_args, default_partition, worker_args, worker_partitions, worker_num_warps, worker_num_regs):
        raise AssertionError("never called")

    monkeypatch.setattr(gl, "warp_specialize", old_style)
    assert not dispatch.detect_capabilities().gluon_hopper
    monkeypatch.delattr(tl, "make_tensor_descriptor")
    assert not dispatch.detect_capabilities().split_kernels


@needs_hopper_triton
def test_the_hopper_backend_needs_compute_capability_9(monkeypatch):
    assert dispatch.hopper_available(HOPPER) and dispatch.hopper_available(Target((9, 1)))
    assert not dispatch.hopper_available(AMPERE) and not dispatch.hopper_available(BLACKWELL)
    assert dispatch.hopper_available(INTERPRETER)  # the split kernels, interpreted
    monkeypatch.setattr(dispatch, "capabilities", lambda: dispatch.Capabilities(False, True))
    assert not dispatch.hopper_available(HOPPER) and dispatch.hopper_available(INTERPRETER)


@needs_hopper_triton
def test_backend_resolution(no_override, monkeypatch):
    assert dispatch.resolve_backend(None, INTERPRETER) == "portable"  # the CPU: portable unless asked
    assert dispatch.resolve_backend("auto", HOPPER) == "sm90"
    assert dispatch.resolve_backend(None, AMPERE) == "portable"
    assert dispatch.resolve_backend("portable", HOPPER) == "portable"
    assert dispatch.resolve_backend("sm90", INTERPRETER) == "sm90"
    with pytest.raises(ValueError, match=r"backend 'sm90' needs a Hopper GPU .* not on compute capability \(8, 0\)"):
        dispatch.resolve_backend("sm90", AMPERE)
    with pytest.raises(ValueError, match=r"backend must be None, 'auto', 'portable' or 'sm90', got 'hopper'"):
        dispatch.resolve_backend("hopper", HOPPER)
    monkeypatch.setenv(dispatch.OVERRIDE_VARIABLE, "portable")
    dispatch.kernel_override.cache_clear()
    assert dispatch.resolve_backend(None, HOPPER) == "portable"
    assert dispatch.resolve_backend("sm90", HOPPER) == "sm90"  # an explicit backend is what the caller asked for


def test_a_bad_override_raises_in_every_call(no_override, monkeypatch):
    """Read once; a bad value is a ValueError naming the variable and what it accepts, from the launchers'
    device check (so from flash_attn_func, and from the ring before its first collective)."""
    monkeypatch.setenv(dispatch.OVERRIDE_VARIABLE, "sm90")
    dispatch.kernel_override.cache_clear()
    match = r"\$RINGATTN_KERNELS must be one of auto, portable \(or unset\), got 'sm90'"
    with pytest.raises(ValueError, match=match):
        dispatch.kernel_override()
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match=match):
        attn_fwd(q, q, q, 0.25, False)


@needs_hopper_triton
def test_forward_takes_the_gluon_kernel_only_where_its_table_does():
    q, k, v, _ = _tensors()
    assert _fwd_name(_fwd(q, k, v)) == "sm90.fwd"
    assert _fwd_name(_fwd(q, k, v, causal=True)) == "sm90.fwd"
    launch = fwd_launch(_fwd(q, k, v, out_dtype=torch.float32), "sm90", HOPPER)  # the ring's first step
    assert launch.name == "sm90.fwd" and launch.kwargs["OUT_FP32"] and not launch.kwargs["MERGE_STATE"]
    launch = fwd_launch(_fwd(q, k, v, out_dtype=torch.float32, merge_state=True), "sm90", HOPPER)  # later steps
    assert launch.name == "sm90.fwd" and launch.kwargs["OUT_FP32"] and launch.kwargs["MERGE_STATE"]
    assert _fwd_name(_fwd(*_tensors(heads=(4, 1))[:3])) == "sm90.fwd"  # MQA
    ids = torch.zeros(64, dtype=torch.int32)
    assert _fwd_name(_fwd(q, k, v, q_doc_ids=ids, k_doc_ids=ids)) == "portable.fwd"  # documents
    final = FinalRows(torch.empty_like(q), range(0, 32))
    launch = fwd_launch(_fwd(q, k, v, out_dtype=torch.float32, merge_state=True, final=final), "sm90", HOPPER)
    assert launch.name == "sm90.fwd" and launch.kwargs["HAS_FINAL_ROWS"]  # the ring's finishing step
    assert _fwd_name(_fwd(q, k, v, final=final)) == "portable.fwd"  # rows finished from out in q's dtype
    assert _fwd_name(_fwd(*_tensors(head_dim=64)[:3])) == "portable.fwd"  # D = 64: slower there
    assert _fwd_name(_fwd(*_tensors(head_dim=80)[:3])) == "portable.fwd"
    launch = fwd_launch(_fwd(*_tensors(head_dim=256)[:3]), "sm90", HOPPER)  # D = 256 in tiles of 64 keys
    assert launch.name == "sm90.fwd" and (launch.kwargs["BLOCK_N"], launch.kwargs["BLOCK_D"]) == (64, 256)


@needs_hopper_triton
def test_head_dim_96_runs_the_gluon_kernels_in_128_column_tiles():
    """D = 96 on the Gluon forward and backward: every descriptor 128 columns wide (TMA fills the columns past 96
    with zeros and stores none of them), the kernels told D = 96 for the stores by pointers."""
    q, k, v, dout = _tensors(head_dim=96)
    fwd = fwd_launch(_fwd(q, k, v, out_dtype=torch.float32, merge_state=True), "sm90", HOPPER)
    (bwd,) = bwd_launches(_bwd(q, k, v, dout, grads_dtype=torch.float32), "sm90", HOPPER)
    for launch in (fwd, bwd):
        assert (launch.kwargs["HEAD_DIM"], launch.kwargs["BLOCK_D"]) == (96, 128), launch.name
        descriptors = [a for a in launch.args if hasattr(a, "block_shape") and len(a.block_shape) == 4]
        assert descriptors and {a.block_shape[-1] for a in descriptors} <= {64, 128}, launch.name
        assert all(a.shape[-1] == 96 for a in descriptors), launch.name
    assert [a.block_shape[-1] for a in fwd.args[:3]] == [128] * 3  # q, k, v
    assert _fwd_name(_fwd(*_tensors(dtype=torch.float32)[:3])) == "portable.fwd"
    offset = torch.randn(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape)  # base address off 16 bytes
    assert _fwd_name(_fwd(q, offset, v)) == "portable.fwd"
    assert _fwd_name(_fwd(q, k, v), backend="portable") == "portable.fwd"
    assert _fwd_name(_fwd(q, k, v), backend=None, target=AMPERE) == "portable.fwd"
    assert _fwd_name(_fwd(q, k, v), backend="sm90", target=INTERPRETER) == "portable.fwd"  # Gluon: GPUs only


@needs_hopper_triton
def test_backward_takes_the_gluon_kernel_where_its_table_does():
    """Every call of a head dim of its table on the Gluon backward but deterministic ones (on the split pair); the
    rest where the Gluon kernel cannot take them on the portable pair."""
    q, k, v, dout = _tensors(head_dim=128)
    gluon, split, fallback = ("sm90.bwd",), ("sm90.dkdv", "sm90.dq"), ("portable.dkdv", "portable.dq")

    def names(*tensors, **kwargs):
        return _bwd_names(_bwd(*(tensors or (q, k, v, dout)), **dict(dict(causal=True), **kwargs)))

    assert names() == names(causal=False) == gluon
    assert names(deterministic=True) == split  # one writer per gradient row
    assert names(*_tensors(head_dim=64)) == names(*_tensors(head_dim=64), causal=False) == gluon
    assert names(*_tensors(head_dim=96)) == gluon  # in 128-column tiles
    assert names(*_tensors(head_dim=80)) == fallback
    assert names(*_tensors(head_dim=256)) == gluon
    for head_dim, split_cols in ((128, False), (256, True)):  # at D = 256 the consumers split the columns
        (launch,) = bwd_launches(_bwd(*_tensors(head_dim=head_dim), grads_dtype=torch.float32), "sm90", HOPPER)
        assert launch.kwargs["SPLIT_COLS"] == split_cols, head_dim
    ids = torch.zeros(64, dtype=torch.int32)
    assert names(q_doc_ids=ids, k_doc_ids=ids) == fallback  # documents
    assert names(*_tensors(seqlen_q=97)) == gluon  # any length: the stats are padded to whole tiles
    gq, gk, gv, gdout = _tensors(heads=(4, 2))
    assert names(gq, gk, gv, gdout) == gluon  # GQA
    unpacked = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (gq, gk, gv, gdout)]
    assert names(*unpacked) == gluon  # (B, S, H, D) views of (B, H, S, D): any head stride
    broadcast = gdout[:, :, :1].expand_as(gdout)  # one head's gradient for every head (stride 0)
    assert names(gq, gk, gv, broadcast) != gluon  # not for the host descriptors: the other kernels'
    expanded_k = gk[:, :, :1].expand_as(gk)
    launch = fwd_launch(_fwd(gq, expanded_k, gv), "sm90", HOPPER)
    assert launch.name == "portable.fwd" and not launch.kwargs["KV_TMA"]  # its K by pointers, not a descriptor
    # a gradient pooled over the sequence (stride 0 along it): never a TMA descriptor's rows (regression: the split
    # kernels built in-kernel descriptors of row stride 0)
    pooled = gdout[:, :1].expand_as(gdout)
    assert names(gq, gk, gv, pooled, deterministic=True) == fallback
    # the ring's forms: fp32 accumulators, dQ added or stored, dK and dV stored or added, rows finished
    final = FinalRows(torch.empty_like(q), range(0, 32))
    for kwargs in (dict(add_dq=True), dict(add_dkdv=True), dict(add_dq=True, dq_final=final)):
        assert names(grads_dtype=torch.float32, **kwargs) == gluon
    # dQ added into (or finished from) a 16-bit buffer: not the fp32 accumulator the kernel adds into
    assert names(add_dq=True) != gluon
    assert names(dq_final=final) != gluon
    assert names(*_tensors(dtype=torch.float32)) == fallback  # fp32 on a GPU would be tf32
    call = _bwd(q, k, v, dout, causal=True)
    assert _bwd_names(call, target=INTERPRETER) == split  # Gluon: GPUs only
    assert _bwd_names(call, backend="portable") == fallback
    assert _bwd_names(call, backend=None, target=AMPERE) == fallback


@needs_hopper_triton
def test_windows_and_softcap_take_the_gluon_kernels():
    """The Gluon forward and backward take sliding windows and soft-capping (passed as the key band and the capped
    scale); the split kernels take neither, so a deterministic call with either goes to the portable pair."""
    q, k, v, dout = _tensors(seqlen_q=64, seqlen_k=96)
    for options in (dict(window=(16, None)), dict(window=(8, 3)), dict(softcap=30.0), dict(window=(4, 0), softcap=5.0)):
        for causal in (False, True):
            launch = fwd_launch(_fwd(q, k, v, causal=causal, **options), "sm90", HOPPER)
            assert launch.name == "sm90.fwd", options
            lower, upper = launch.args[-6:-4]  # (..., lower, upper, qk_scale, cap_scale, final_lo, final_hi)
            left, right = options.get("window", (None, None))
            flags = {name: launch.kwargs[name] for name in ("LOWER", "UPPER", "SOFTCAP")}
            assert flags == dict(LOWER=left is not None, UPPER=causal or right is not None,
                                 SOFTCAP="softcap" in options)  # fmt: skip
            if left is not None:  # bottom-right: row i sees keys from i + 32 - left
                assert lower == 32 - left
            if flags["UPPER"]:  # causal caps the window's right side at 0
                assert upper == 32 + (min(right or 0, 0) if causal else right)
            assert _bwd_names(_bwd(q, k, v, dout, causal=causal, **options), "sm90", HOPPER) == ("sm90.bwd",)
            deterministic = _bwd(q, k, v, dout, causal=causal, deterministic=True, **options)
            assert _bwd_names(deterministic, "sm90", HOPPER) == ("portable.dkdv", "portable.dq")


def test_configs_come_from_the_tables_and_overrides_restore(no_override):
    assert launch_config("sm90.fwd", 128, torch.bfloat16, HOPPER) == sm90.TABLE["fwd"][128]
    assert launch_config("sm90.dq", 64, torch.bfloat16, HOPPER) is None
    assert launch_config("sm90.dkdv", 64, torch.float32, INTERPRETER) == portable.INTERPRETER_CONFIG
    assert launch_config("portable.fwd", 40, torch.bfloat16, HOPPER) == portable.CONFIGS_16BIT["fwd"][0][1]
    assert launch_config("portable.dq", 40, torch.float32, INTERPRETER) == portable.INTERPRETER_CONFIG
    for capability in ((8, 6), (8, 9), (12, 0)):  # blocks of at most 99 KiB of shared memory
        small = Target(capability)
        assert launch_config("portable.fwd", 128, torch.bfloat16, small) == portable.SMALL_SMEM_16BIT["fwd"][128]
        assert launch_config("portable.dq", 64, torch.float16, small) == portable.SMALL_SMEM_16BIT["dq"][128]
        assert launch_config("portable.dkdv", 256, torch.bfloat16, small) == portable.SMALL_SMEM_16BIT["dkdv"][256]
        assert launch_config("portable.dkdv", 128, torch.bfloat16, small) == portable.CONFIGS_16BIT["dkdv"][1][1]
        for kernel in ("fwd", "dkdv", "dq"):  # fp32: the table's configs fit
            for head_dim, (_, config) in zip((128, 256), portable.CONFIGS_FP32[kernel], strict=True):
                assert launch_config(f"portable.{kernel}", head_dim, torch.float32, small) == config
    for large in (Target((8, 0)), HOPPER):
        assert launch_config("portable.fwd", 128, torch.bfloat16, large) == portable.CONFIGS_16BIT["fwd"][1][1]
        assert launch_config("portable.dkdv", 256, torch.float32, large) == portable.CONFIGS_FP32["dkdv"][1][1]
    swept = LaunchConfig(64, 32, 4, 3)
    with override_configs({"portable.fwd": swept, "sm90.dq": swept}):
        assert launch_config("portable.fwd", 40, torch.bfloat16, HOPPER) == swept
        assert launch_config("sm90.dq", 128, torch.bfloat16, HOPPER) == swept
        assert launch_config("sm90.dq", 64, torch.bfloat16, HOPPER) is None  # still where the table takes it
    assert launch_config("portable.fwd", 40, torch.bfloat16, HOPPER) == portable.CONFIGS_16BIT["fwd"][0][1]
    with pytest.raises(ValueError, match="unknown kernels"):
        with override_configs({"sm90.dkdv_ws": swept}):
            pass
    with pytest.raises(ValueError, match="kernel must be one of"):
        launch_config("portable.bwd", 64, torch.bfloat16, HOPPER)


@needs_hopper_triton
def test_softcapped_backward_takes_the_softcapped_config_where_there_is_one():
    """At D = 64 the soft-capped Gluon backward runs SOFTCAPPED's rows a step (TABLE's spill there); at D = 128,
    capped or not, TABLE's."""
    assert sm90.SOFTCAPPED["bwd"][64] != sm90.TABLE["bwd"][64]
    for head_dim, softcap, table in ((64, 0.0, sm90.TABLE), (64, 30.0, sm90.SOFTCAPPED), (128, 30.0, sm90.TABLE)):
        q, k, v, dout = _tensors(head_dim=head_dim)
        (launch,) = bwd_launches(_bwd(q, k, v, dout, grads_dtype=torch.float32, softcap=softcap), "sm90", HOPPER)
        want = table["bwd"][head_dim]
        assert (launch.kwargs["BLOCK_M"], launch.kwargs["BLOCK_N"]) == (want.block_m, want.block_n), (head_dim, softcap)
        assert launch_config("sm90.bwd", head_dim, torch.bfloat16, HOPPER, softcapped=bool(softcap)) == want


def test_portable_kernels_take_tanh_approx_for_16_bit_inputs_on_a_gpu():
    """Soft-capped, the portable kernels take the GPU's tanh.approx for 16-bit inputs; fp32 inputs and the
    interpreter (no inline PTX) the exp2 form, to about one ulp."""
    for dtype, target, approx in (
        (torch.bfloat16, AMPERE, True),
        (torch.float16, HOPPER, True),
        (torch.float32, AMPERE, False),
        (torch.bfloat16, INTERPRETER, False),
    ):
        q, k, v, dout = _tensors(head_dim=96, dtype=dtype)
        launches = [fwd_launch(_fwd(q, k, v, softcap=30.0), "portable", target)]
        launches += bwd_launches(_bwd(q, k, v, dout, softcap=30.0), "portable", target)
        assert [launch.kwargs["APPROX_TANH"] for launch in launches] == [approx] * 3, (dtype, target)


def test_every_kernel_name_is_a_launch_name():
    """KERNELS names what the planners build (the sweep and the resource report go by these names)."""
    q, k, v, dout = _tensors()
    names = {fwd_launch(_fwd(q, k, v), b, HOPPER).name for b in ("portable", "sm90")}
    names |= {
        n
        for b in ("portable", "sm90")
        for c in (False, True)
        for d in (False, True)
        for n in _bwd_names(_bwd(q, k, v, dout, causal=c, deterministic=d), b)
    }
    if HOPPER_TRITON:
        assert names == set(dispatch.KERNELS)
    assert names <= set(dispatch.KERNELS)
    names = {"kernel", "head_dim", "dtype", "target", "softcapped"}
    assert set(inspect.signature(dispatch.launch_config).parameters) == names


def test_short_backwards_run_on_two_streams_on_gpus_only():
    """At most 2^32 score entries (halved when causal); CPU tensors never (no streams)."""
    q, k, v, dout = _tensors(seqlen_q=8, seqlen_k=8)
    call = _bwd(q, k, v, dout)
    assert dispatch.short_backward(call) and not dispatch.bwd_on_two_streams(call, bwd_launches(call, "portable"))
    big = torch.empty(1, 2**16, 1, 8).expand(2, 2**16, 2, 8)  # B Hq Sq Sk = 2^34: too many, causal or not
    for causal, short in ((False, False), (True, False)):
        assert dispatch.short_backward(_bwd(big, big, big, big, causal=causal)) is short
    half = torch.empty(1, 2**16, 1, 8).expand(1, 2**16, 2, 8)  # 2^33: causal halves it to 2^32
    assert not dispatch.short_backward(_bwd(half, half, half, half))
    assert dispatch.short_backward(_bwd(half, half, half, half, causal=True))
