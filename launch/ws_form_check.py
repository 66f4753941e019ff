"""Check each form of the warp-specialised kernels alone (ops/warp_spec.py's names), to decide CHECKED_FORMS.

    PYTHONPATH=/tmp/triton:. TRITON_BACKENDS_IN_TREE=1 python3 launch/ws_form_check.py --out ws_forms.json

Each form is the only one allowed while its cases run (warp_spec.ws_allowed patched), so a wrong form cannot hide
behind another one's failure, as it does in the test suite, where a wrong forward stops a case before its
backward is checked. Every case checks the form's result tensors (out and lse; dq; dk and dv) against float64
under the tolerance rule (ringattn.testing.check_results, the plain implementation in the inputs' dtype), that the
form was taken, and that a second run gives the same bits. The forms written for the ring are called as the ring
calls them: the forward into an fp32 state (fp32), merged into a state after a first block of keys every row
sees (merge); dQ, dK and dV stored into fp32 buffers (fp32) or dQ added into one (accumulate).

Lengths: Sq = Sk over several tiles, ragged against the tiles, and Sq != Sk both ways (causal Sq > Sk: rows that
see no key). Heads: MHA, GQA 4:2 and MQA 4:1 (dK/dV: MHA without " gqa", GQA and MQA with it). Prints one line a
case and a verdict per form; writes every case as JSON. On a CPU it runs the interpreter (tiny shapes, fp32).
"""

import argparse
import itertools
from collections.abc import Callable
from contextlib import contextmanager

import torch
from bench_common import env_record, write_json

from ringattn.ops import attn_bwd, attn_fwd, attn_fwd_merge_, warp_spec
from ringattn.testing import check_results, reference

GPU_LENGTHS = [(256, 256), (300, 300), (200, 456), (1000, 1000), (512, 136)]
CPU_LENGTHS = [(132, 132), (68, 100)]


@contextmanager
def only_form(form: str):
    """Inside: warp_spec allows `form` alone, on any device; yields the set of forms a call asked for and got."""
    allowed, taken = warp_spec.ws_allowed, set()

    def ws_allowed(asked: str, device: torch.device, head_dim: int) -> bool:
        if asked == form:
            taken.add(asked)
        return asked == form

    warp_spec.ws_allowed = ws_allowed
    try:
        yield taken
    finally:
        warp_spec.ws_allowed = allowed


def _inputs(batch, seqlen_q, seqlen_k, heads, head_dim, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    hq, hk = heads
    shapes = ((seqlen_q, hq), (seqlen_k, hk), (seqlen_k, hk), (seqlen_q, hq))
    return [torch.randn(batch, s, h, head_dim, device=device, dtype=dtype, generator=gen) for s, h in shapes]


def _first_block(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Keys of the merge's first block, which every row sees (causal, bottom-right: at most Sk - Sq + 1); 0: none
    fits."""
    return max(0, min(seqlen_k // 3, seqlen_k - seqlen_q + 1 if causal else seqlen_k))


def _run(form: str, q, k, v, dout, scale: float, causal: bool) -> dict[str, torch.Tensor] | None:
    """The form's results, called as its users call it; None where the case cannot express the form."""
    kernel = form.split()[0]
    if kernel == "fwd" and "merge" in form:
        s0 = _first_block(q.shape[1], k.shape[1], causal)
        if s0 == 0:
            return None
        with only_form("none"):  # the first block by the default kernels, into the fp32 state
            out, lse = attn_fwd(q, k[:, :s0], v[:, :s0], scale, False, out_dtype=torch.float32)
        attn_fwd_merge_(q, k[:, s0:], v[:, s0:], scale, causal, out, lse)
        return {"out": out, "lse": lse}
    if kernel == "fwd":
        out, lse = attn_fwd(q, k, v, scale, causal, out_dtype=torch.float32 if "fp32" in form else None)
        return {"out": out, "lse": lse}
    with only_form("none"):
        out, lse = attn_fwd(q, k, v, scale, causal)
    if "fp32" in form or "accumulate" in form:
        held = torch.randn(q.shape, device=q.device, generator=torch.Generator(q.device).manual_seed(1))
        dq = held.clone() if "accumulate" in form else torch.full(q.shape, float("nan"), device=q.device)
        dk, dv = (torch.full(t.shape, float("nan"), device=q.device) for t in (k, v))
        attn_bwd(dout, q, k, v, out, lse, scale, causal, dq_acc=dq, dk_acc=dk, dv_acc=dv,
                 add_dq="accumulate" in form, add_dkdv=False)  # fmt: skip
        if "accumulate" in form:
            dq = dq - held
    else:
        dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, scale, causal)
    return {"dq": dq} if kernel == "dq" else {"dk": dk, "dv": dv}


def check_case(form: str, batch, seqlen_q, seqlen_k, heads, head_dim, dtype, device) -> dict:
    """One case of one form: per result tensor its error and allowed error, taken, same bits twice, ok."""
    causal = "causal" in form.split()
    scale = head_dim**-0.5
    q, k, v, dout = _inputs(batch, seqlen_q, seqlen_k, heads, head_dim, dtype, device, seqlen_q + 7 * seqlen_k)
    case = dict(form=form, B=batch, Sq=seqlen_q, Sk=seqlen_k, Hq=heads[0], Hkv=heads[1], D=head_dim)
    with only_form(form) as taken:
        got = _run(form, q, k, v, dout, scale, causal)
        again = _run(form, q, k, v, dout, scale, causal) if got is not None else None
    if got is None:
        return dict(case, ok=None, note="no first block every row sees")
    ref = reference(q, k, v, dout, scale, causal, torch.float64)
    plain = reference(q, k, v, dout, scale, causal, dtype)
    case.update(taken=form in taken, same_bits=all(torch.equal(got[n], again[n]) for n in got), errors={})
    ok = case["taken"] and case["same_bits"]
    for name, tensor in got.items():
        try:
            ((err, allowed),) = check_results("", {name: tensor}, plain, ref).values()
        except AssertionError as exc:
            case["errors"][name] = str(exc)
            ok = False
        else:
            case["errors"][name] = f"{err:.2e} <= {allowed:.2e}"
    return dict(case, ok=ok)


def check_forms(forms: list[str], lengths, head_dims, dtype, device, print_line: Callable = print) -> list[dict]:
    """Every case of every form in `forms`, in order; prints a line per case."""
    records = []
    for form in forms:
        if " gqa" in form:
            head_layouts = [(4, 2), (4, 1)]
        elif form.startswith("dkdv"):  # without " gqa": MHA
            head_layouts = [(4, 4)]
        else:
            head_layouts = [(4, 4), (4, 2), (4, 1)]
        for (seqlen_q, seqlen_k), heads, head_dim in itertools.product(lengths, head_layouts, head_dims):
            batch = 2 if seqlen_q * seqlen_k <= 300 * 300 else 1
            try:
                record = check_case(form, batch, seqlen_q, seqlen_k, heads, head_dim, dtype, device)
            except Exception as exc:  # noqa: BLE001 (a form that fails to compile or launch is a result too)
                record = dict(form=form, Sq=seqlen_q, Sk=seqlen_k, Hq=heads[0], Hkv=heads[1], D=head_dim, ok=False,
                              error=f"{type(exc).__name__}: {str(exc)[:300]}")  # fmt: skip
            records.append(record)
            print_line(f"{form:22s} Sq{seqlen_q} Sk{seqlen_k} H{heads[0]}/{heads[1]} D{head_dim}: "
                       f"{'-' if record['ok'] is None else 'ok' if record['ok'] else 'WRONG'} "
                       f"{record.get('errors', record.get('error', record.get('note')))}"
                       f"{'' if record.get('taken', True) else ' (not taken)'}"
                       f"{'' if record.get('same_bits', True) else ' (other bits on a second run)'}")  # fmt: skip
    return records


def verdicts(records: list[dict]) -> dict[str, bool]:
    """Per form: True if every case that applies passed."""
    by_form: dict[str, bool] = {}
    for r in records:
        if r["ok"] is not None:
            by_form[r["form"]] = by_form.get(r["form"], True) and r["ok"]
    return by_form


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--forms", nargs="+", default=warp_spec.WS_FORMS, help="ws_form names (quote each); default: all"
    )
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], choices=list(warp_spec.WS_HEAD_DIMS))
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args()
    unknown = sorted(set(args.forms) - set(warp_spec.WS_FORMS))
    if unknown:
        parser.error(f"--forms: unknown {unknown}; known: {warp_spec.WS_FORMS}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype] if cuda else torch.float32
    records = check_forms(args.forms, GPU_LENGTHS if cuda else CPU_LENGTHS, args.head_dims, dtype, device)
    for form, ok in verdicts(records).items():
        print(f"{form:22s} {'right in every case' if ok else 'WRONG'}")
    write_json(args.out, env_record(device, dtype=str(dtype).removeprefix("torch."), forms=args.forms), records)


if __name__ == "__main__":
    main()
