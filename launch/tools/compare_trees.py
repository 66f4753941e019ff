"""Time ringattn's public flash_attn_func, forward and forward+backward, from two source trees side by side on one
GPU: the check that a change keeps the kernels' speed.

    git archive main ringattn | tar -x -C /tmp/main   # the tree to compare against
    python3 launch/tools/compare_trees.py --trees /tmp/main . --labels main change --out /tmp/compare.json

Each tree runs in its own process (a package can be imported once per process), in the order A B A B ... for
--repeats rounds, so drift of the GPU's clocks falls on both; every process times the same cells (bf16, H = 32,
B x S = 32768 tokens, the grid of --head-dims, --seqlens, K/V heads 32 and 8, causal or not, --softcaps) with
triton.testing.do_bench (median), and records the sum of its forward's output, so that trees whose kernels round
differently show it. Writes JSON (environment, one record per tree, round, cell and mode) and prints per cell the
median over rounds of each tree, their ratio, and the range of the rounds' own ratios: on an H100 the same code has
moved by up to 5% of forward+backward time between two processes, so a ratio means something only where it stays
outside that range's spread (comparing a tree with itself shows the spread).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

TOKENS, HEADS = 32768, 32


def _cells(head_dims: list[int], seqlens: list[int], softcaps: list[float]) -> list[dict]:
    return [
        dict(B=TOKENS // s, S=s, H=HEADS, Hkv=hkv, D=d, causal=causal, softcap=cap)
        for d in head_dims for s in seqlens for hkv in (HEADS, 8) for causal in (False, True) for cap in softcaps
    ]  # fmt: skip


def _time_cell(cell: dict) -> list[dict]:
    """In the worker process: one cell's forward and forward+backward median ms (ringattn from sys.path)."""
    import torch
    from triton.testing import do_bench

    import ringattn

    gen = torch.Generator(device="cuda").manual_seed(cell["S"] + cell["D"] + cell["Hkv"])
    shape_q, shape_kv = (cell["B"], cell["S"], cell["H"], cell["D"]), (cell["B"], cell["S"], cell["Hkv"], cell["D"])
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k, v = (torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
            for _ in range(2))  # fmt: skip
    dout = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=gen)
    options = dict(causal=cell["causal"], softcap=cell["softcap"])
    digest = float(ringattn.flash_attn_func(q, k, v, **options).float().sum())

    def fwd():
        with torch.no_grad():
            ringattn.flash_attn_func(q, k, v, **options)

    def fwd_bwd():
        ringattn.flash_attn_func(q, k, v, **options).backward(dout)

    return [
        dict(cell, mode=mode, ms=do_bench(fn, warmup=50, rep=300, return_mode="median"), out_sum=digest)
        for mode, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd))
    ]


def _time_cells(cells: list[dict]) -> list[dict]:
    """In the worker process: _time_cell of every cell."""
    return [record for cell in cells for record in _time_cell(cell)]


def _worker(tree: str, cells: list[dict]) -> list[dict]:
    """Run _time_cells in a fresh process with `tree` first on sys.path."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2]);"
        "from compare_trees import _time_cells; print(json.dumps(_time_cells(json.loads(sys.argv[3]))))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-c", code, str(Path(tree).resolve()), str(Path(__file__).parent), json.dumps(cells)],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the worker on {tree} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _environment() -> dict:
    import torch
    import triton

    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs=2, required=True, metavar=("A", "B"), help="two source trees")
    parser.add_argument("--labels", nargs=2, default=("A", "B"), help="their names in the records")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--softcaps", type=float, nargs="+", default=[0.0], help="soft-caps (0: none)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of A B")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        parser.error("it times CUDA kernels: no GPU here")
    cells = _cells(args.head_dims, args.seqlens, args.softcaps)
    records = []
    for round_ in range(args.repeats):
        for tree, label in zip(args.trees, args.labels, strict=True):
            records += [dict(r, tree=label, round=round_) for r in _worker(tree, cells)]
    args.out.write_text(json.dumps(dict(environment=_environment(), command=sys.argv, records=records), indent=1))
    print(table(records, args.labels))


def table(records: list[dict], labels: tuple[str, str]) -> str:
    """Markdown table of records (as main writes them): per cell and mode, each tree's median ms over the rounds,
    their ratio, and the lowest and highest of the rounds' own ratios (B's time in round r over A's), the spread a
    ratio has to leave before it says more than the GPU's drift between processes."""
    a, b = labels
    fields = ("D", "S", "Hkv", "causal", "softcap", "mode")
    lines = [f"| D | S | Hkv | causal | softcap | mode | {a} ms | {b} ms | {b} / {a} | rounds' {b} / {a} |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for key in sorted({tuple(r[f] for f in fields) for r in records}, reverse=True):
        ms = {(r["tree"], r["round"]): r["ms"] for r in records if tuple(r[f] for f in fields) == key}
        rounds = sorted({round_ for _, round_ in ms})
        median = {label: statistics.median(ms[label, round_] for round_ in rounds) for label in labels}
        ratios = [ms[b, round_] / ms[a, round_] for round_ in rounds]
        lines.append("| " + " | ".join(map(str, key)) + f" | {median[a]:.3f} | {median[b]:.3f} | "
                     f"{median[b] / median[a]:.3f} | {min(ratios):.3f} to {max(ratios):.3f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
