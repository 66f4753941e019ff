"""Registers, spills and shared memory of the attention kernels compiled for a GPU architecture, on any
machine (no GPU needed): the resource report to read before guessing why a kernel is slow.

    python3 -m venv --system-site-packages /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0  # the GPU image's
    PYTHONPATH=. /tmp/t36/bin/python launch/tools/kernel_resources.py --out docs/benchmarks/kernel_resources_sm90.json
    PYTHONPATH=. python3 launch/tools/kernel_resources.py --kernels portable.dkdv --head-dims 128 \
        --configs 64,64,4,2 128,64,8,2
    PYTHONPATH=. python3 launch/tools/kernel_resources.py --candidates   # every config config_sweep.py times

The launches are the dispatch's own (ringattn.ops.fwd_launch, bwd_launches, planned for --arch from CPU tensors laid
out as in launch/bench/bench_kernel.py: bf16 (--dtype another), H = 32, strides divisible by 16, so the same
specialisation as the benchmark's), then compiled, not run, by the installed triton for --arch. `ptxas -v` on the
PTX gives the registers per thread and the spill bytes, and nvdisasm's SASS the spill instructions inside the
innermost loop that issues tensor-core products ("loop spills": a key loop's, paid every step, where the bytes count
spills anywhere); shared memory is the compiler's. CTAs per SM is the least of what registers (65536 per SM), shared
memory (228 KiB per SM, 227 KiB at most per CTA) and threads (2048 per SM) allow, for --arch's limits. Kernels
(--kernels): each of ringattn.ops.KERNELS as the ring calls it (the backward: dQ added to an fp32 accumulator, dK,
dV stored into fp32 shares), and the forwards also as the ring's step merging into an fp32 state
("portable.fwd-merge", "sm90.fwd-merge"); a Hopper kernel at the head dims its table takes. "ws partitions" counts
the warp-specialised regions (the partitioner's, or the Gluon forward's one explicit region), "ws hazards" the ops
in them the partitioner is known to split wrong (ws_hazards()), "wgmma serialized" whether ptxas made every wgmma
wait for the one before (it does so when other instructions touch a pending product's accumulator registers, or
registers run short: the overlap of products with the softmax is gone); the Gluon forward's config's fourth number
is its rings' depth. Without --configs or --candidates, each at the tables' config. Forms the dispatch does not run
(a head dim outside a table) are left out; the split backward kernels are compiled as deterministic calls run them,
at every causal setting. --window and --softcap compile the sliding-window and soft-capped forms instead.
"""

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from config_sweep import CANDIDATES
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource, make_backend
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import create_function_from_signature

from ringattn.benchmark import markdown_table, write_json
from ringattn.ops import (
    BwdCall,
    FwdCall,
    KernelLaunch,
    LaunchConfig,
    Target,
    bwd_launches,
    fwd_launch,
    launch_config,
    override_configs,
)

# the forms compiled: each kernel of ringattn.ops.KERNELS as the ring calls it, and the forwards also as the ring's
# merging step ("...-merge")
KERNELS = ("portable.fwd", "portable.fwd-merge", "portable.dkdv", "portable.dq", "sm90.fwd", "sm90.fwd-merge",
           "sm90.bwd", "sm90.dkdv", "sm90.dq")  # fmt: skip
HEADS, SEQLEN = 32, 64  # strides as the benchmark's; the length is not specialised on
REGS_PER_SM, THREADS_PER_SM = 65536, 2048
# shared memory per SM and at most per CTA, KiB, by compute capability x 10 (CUDA's tuning guides)
SMEM_KIB = {80: (164, 163), 86: (100, 99), 89: (100, 99), 90: (228, 227)}


def _launch(kernel: str, head_dim: int, kv_heads: int, causal: bool, cfg, arch: int = 90, window=(None, None),
            softcap: float = 0.0, dtype: torch.dtype = torch.bfloat16) -> KernelLaunch:  # fmt: skip
    """The launch the dispatch builds for `kernel` (a form of KERNELS) from CPU tensors of `dtype` for a GPU of
    compute capability arch / 10, with config `cfg` (None: the tables'), a sliding window (left, right) and softcap.
    Raises ValueError where the backend's table does not take the form."""
    name, merge = kernel.removesuffix("-merge"), kernel.endswith("-merge")
    backend = name.split(".")[0]
    target = Target(divmod(arch, 10))
    q, dout = (torch.empty(1, SEQLEN, HEADS, head_dim, dtype=dtype) for _ in range(2))
    k, v = (torch.empty(1, SEQLEN, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    lse, stats = torch.empty(1, HEADS, SEQLEN, dtype=torch.float64), torch.empty(3, 1, HEADS, SEQLEN)
    scale = head_dim**-0.5
    with override_configs({name: cfg} if cfg is not None else {}):
        if name.endswith(".fwd"):
            out = torch.empty(q.shape, dtype=torch.float32 if merge else q.dtype)
            call = FwdCall(q, k, v, scale, causal, out, lse, merge_state=merge, window=window, softcap=softcap)
            launches = [fwd_launch(call, backend, target)]
        else:  # as the ring calls them: dQ added to an fp32 accumulator, dK, dV stored into fp32 shares; the split
            # kernels as deterministic calls take them (where the Gluon backward takes the others)
            acc = [torch.empty(t.shape) for t in (q, k, v)]
            split = name in ("sm90.dkdv", "sm90.dq")
            call = BwdCall(dout, q, k, v, stats, *acc, scale, causal, add_dq=True, add_dkdv=False,
                           deterministic=split, window=window, softcap=softcap)  # fmt: skip
            launches = bwd_launches(call, backend, target)
    launch = next((launch for launch in launches if launch.name == name), None)
    if launch is None:
        raise ValueError(f"{kernel} does not take D = {head_dim} (the launch is {launches[-1].name})")
    return launch


def compile_launch(launch: KernelLaunch, target: GPUTarget):
    """Compile `launch` for `target` as JITFunction.run would on such a GPU, without running it (through
    triton's binder and _pack_args, internals that triton 3.6 to 3.9 share)."""
    backend = make_backend(target)
    fn = launch.kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.kwargs)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    source = ASTSource
    if fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return triton.compile(source(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def ws_hazards(ttgir: str) -> int:
    """Ops in a warp-specialised region that triton 3.9's partitioner was seen to get wrong (kernels/sm90/attn_bwd.py's
    docstring): a `tl.arange` range (added to the program's tile start, the second consumer's offset counted
    twice) and a reshaped shared-memory tile (its buffer released to the producer before the products read it)."""
    return sum(
        "async_task_id" in line and ("tt.make_range" in line or "ttg.memdesc_reshape" in line)
        for line in ttgir.splitlines()
    )


LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BACK_BRANCH = re.compile(r"@!?U?P\d+\s+BRA\s+`?\(?(\.L_x_\d+)")


def product_loop_spills(sass: str) -> int:
    """Spill instructions (local-memory LDL, STL) inside the innermost loops that issue tensor-core products
    (HGMMA) in a kernel's SASS (nvdisasm's): its key or query loop, where a spill costs every step. A loop is the
    code from a label to a predicated branch back to it; the retry loops of barrier waits issue no products, and an
    outer loop (a persistent kernel's walk over output tiles) holds the inner one, so neither counts."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := LABEL.match(line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := BACK_BRANCH.search(line)) and labels.get(m.group(1), i) < i]  # fmt: skip
    product_loops = [(a, b) for a, b in loops if any("HGMMA" in line for line in lines[a:b])]
    innermost = [(a, b) for a, b in product_loops
                 if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in product_loops)]  # fmt: skip
    return sum(bool(re.search(r"\b(LDL|STL)\b", line)) for a, b in innermost for line in lines[a : b + 1])


def gpu_name(arch: int) -> str:
    """ptxas's name of the GPU of compute capability arch / 10: Hopper's arch-specific sm_90a (wgmma, setmaxnreg)."""
    return f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"


def resources(compiled, arch: int) -> dict:
    """Registers per thread and spill bytes (ptxas -v), shared memory bytes, CTAs per SM, warps (the partitioner's
    included), warp-specialised regions and the ops in them known to be split wrong (ws_hazards), and whether ptxas
    serialised the wgmma products (its performance notes C7510 to C7515 say "instructions are serialized")."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        cmd = [get_ptxas(arch).path, "-v", f"--gpu-name={gpu_name(arch)}", str(ptx), "-o", str(ptx.with_suffix(".o"))]
        report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        cubin = ptx.with_suffix(".o")
        sass = subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if regs is None or spills is None:
        raise RuntimeError(f"unexpected ptxas report: {report}")
    num_warps = compiled.metadata.num_warps
    regs, smem, threads = int(regs.group(1)), compiled.metadata.shared, 32 * num_warps
    limits = [REGS_PER_SM // (regs * threads), THREADS_PER_SM // threads]
    if smem:
        per_sm, per_cta = (kib * 1024 for kib in SMEM_KIB[arch])
        limits.append(per_sm // smem if smem <= per_cta else 0)  # over the per-CTA cap: not launchable
    return dict(
        regs=regs, spill_store_bytes=int(spills.group(1)), spill_load_bytes=int(spills.group(2)),
        loop_spills=product_loop_spills(sass),
        smem_bytes=smem, ctas_per_sm=min(limits), warps=num_warps,
        ws_partitions=compiled.asm["ttgir"].count("ttg.warp_specialize"), ws_hazards=ws_hazards(compiled.asm["ttgir"]),
        wgmma_serialized="wgmma.mma_async instructions are serialized" in report,
    )  # fmt: skip


def measure(kernel: str, head_dim: int, kv_heads: int, causal: bool, cfg, arch: int, window=(None, None),
            softcap: float = 0.0, dtype: torch.dtype = torch.bfloat16) -> dict:  # fmt: skip
    """One record: the kernel's launch config and its resources on `arch` (with a window, softcap and dtype: their
    form)."""
    launch = _launch(kernel, head_dim, kv_heads, causal, cfg, arch, window, softcap, dtype)
    kw = launch.kwargs
    host_descriptors = any(isinstance(a, TensorDescriptor) for a in launch.args)  # the Gluon kernels'
    record = dict(
        kernel=kernel,
        D=head_dim,
        H=HEADS,
        Hkv=kv_heads,
        causal=causal,
        window=list(window),
        softcap=softcap,
        dtype=str(dtype).removeprefix("torch."),
        config=[kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw.get("num_stages", kw.get("NUM_BUFFERS"))],
        tma=bool(kw.get("KV_TMA", False)) or launch.scratch or host_descriptors,
    )  # fmt: skip (scratch: descriptors in-kernel)
    try:
        compiled = compile_launch(launch, GPUTarget("cuda", arch, 32))
    except Exception as err:  # noqa: BLE001 - a config the compiler refuses is a result, recorded
        return dict(record, error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
    return dict(record, **resources(compiled, arch))


def _taken(kernel: str, head_dim: int, kv_heads: int, causal: bool, arch: int, window, softcap: float,
           dtype: torch.dtype) -> bool:  # fmt: skip
    """Whether the dispatch runs the form at the head dim, causal setting and dtype (the Hopper table does not take
    every one)."""
    name = kernel.removesuffix("-merge")
    if not name.startswith("portable.") and launch_config(name, head_dim, dtype, Target((9, 0))) is None:
        return False
    try:
        _launch(kernel, head_dim, kv_heads, causal, None, arch, window, softcap, dtype)
    except ValueError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[HEADS], help="8 for GQA 32:8")
    parser.add_argument("--configs", nargs="+", default=None, help="BLOCK_M,BLOCK_N,warps,stages each")
    parser.add_argument("--candidates", action="store_true", help="config_sweep.py's candidates per kernel and D")
    parser.add_argument("--window", type=int, nargs=2, default=None, metavar=("LEFT", "RIGHT"),
                        help="compile the sliding-window form (-1: no limit on that side)")  # fmt: skip
    parser.add_argument("--softcap", type=float, default=0.0, help="compile the soft-capped form")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    window = (None, None) if args.window is None else tuple(None if side < 0 else side for side in args.window)
    given = None if args.configs is None else [LaunchConfig(*map(int, c.split(","))) for c in args.configs]
    records = []
    for kernel in args.kernels:
        for head_dim in args.head_dims:
            if args.candidates:
                configs = [LaunchConfig(*c) for c in CANDIDATES[kernel.removesuffix("-merge")].get(head_dim, [])]
            else:
                configs = given or [None]
            for kv_heads in args.kv_heads:
                form = (args.arch, window, args.softcap, dtype)
                taken = (c for c in (False, True) if _taken(kernel, head_dim, kv_heads, c, *form))
                for causal in taken:
                    for cfg in configs:
                        records.append(
                            measure(kernel, head_dim, kv_heads, causal, cfg, args.arch, window, args.softcap, dtype)
                        )
                        print(records[-1], file=sys.stderr, flush=True)
    if args.out:
        env = dict(kind="env", triton=triton.__version__, torch=torch.__version__, arch=gpu_name(args.arch))
        write_json(args.out, env, records)
    header = ["kernel", "D", "Hkv", "causal", "config", "TMA", "regs", "spill st/ld B", "loop spills", "smem KiB",
              "CTAs/SM", "warps", "ws partitions", "ws hazards", "wgmma serialized"]  # fmt: skip
    rows = [[r["kernel"], r["D"], r["Hkv"], "yes" if r["causal"] else "no", "x".join(map(str, r["config"])),
             "yes" if r["tma"] else "no"] + ([r["error"], "", "", "", "", "", "", "", ""] if "error" in r else
             [r["regs"], f"{r['spill_store_bytes']}/{r['spill_load_bytes']}", r["loop_spills"],
              f"{r['smem_bytes'] / 1024:.0f}",
              r["ctas_per_sm"], r["warps"], r["ws_partitions"], r["ws_hazards"],
              "yes" if r["wgmma_serialized"] else "no"]) for r in records]  # fmt: skip
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
