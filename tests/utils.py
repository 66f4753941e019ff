"""Helpers shared by the tests: devices, dtypes, inputs and the reference attention."""

import importlib
import importlib.util
import pkgutil
from pathlib import Path

import torch

import ringattn.kernels
from ringattn.ops import attn_fwd_ref, capabilities
from ringattn.testing import RESULTS, check_results

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter runs fp32; on a GPU the kernels are checked in the training dtypes.
DTYPES = [torch.float32] if DEVICE.type == "cpu" else [torch.bfloat16, torch.float16]


ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str):
    """The script at `path` (relative to the repository) as a module, for tests of its functions: its import only
    defines things (main runs under `if __name__ == "__main__"`)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype, device=DEVICE, seed=0):
    """Random q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D) and dout like q, drawn fresh for every seed."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    q = rand(batch, seqlen_q, heads_q, head_dim)
    k = rand(batch, seqlen_k, heads_k, head_dim)
    v = rand(batch, seqlen_k, heads_k, head_dim)
    dout = rand(batch, seqlen_q, heads_q, head_dim)
    return q, k, v, dout


def reference_attention(q, k, v, dout, softmax_scale, causal, dtype, **options):
    """Plain PyTorch attention (attn_fwd_ref + autograd) with inputs cast to `dtype`.

    Returns out, lse, dq, dk, dv, all computed in `dtype` (float64 for the ground truth,
    the inputs' own dtype for the plain implementation of the tolerance rule). options: attn_fwd_ref's
    keyword arguments (q_doc_ids and k_doc_ids for packed documents, window, softcap).
    """
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = attn_fwd_ref(q, k, v, softmax_scale, causal, **options)
    out.backward(dout.to(dtype))
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def check_against_reference(q, k, v, dout, softmax_scale, causal, results, what="", **options):
    """Check results = (out, lse, dq, dk, dv) of one attention call against reference_attention in float64 under
    the tolerance rule (ringattn.testing.check_results); `what` names the call in a failure; options as
    reference_attention's."""
    ref = reference_attention(q, k, v, dout, softmax_scale, causal, torch.float64, **options)
    pt = reference_attention(q, k, v, dout, softmax_scale, causal, q.dtype, **options)
    check_results(what, *(dict(zip(RESULTS, r, strict=True)) for r in (results, pt, ref)))


def package_kernel_names() -> list[str]:
    """The names of every Triton kernel in ringattn/kernels (the Gluon forward's only where Gluon's Hopper ops
    import), as a profiler names them: what the benchmarks find ringattn's kernels by."""
    names = []
    for module in pkgutil.walk_packages(ringattn.kernels.__path__, "ringattn.kernels."):
        if module.name.endswith("sm90.attn_fwd") and not capabilities().gluon_hopper:
            continue  # the Gluon kernel's module needs Gluon's Hopper ops to import
        names += [name for name in vars(importlib.import_module(module.name)) if name.endswith("_kernel")]
    return names
