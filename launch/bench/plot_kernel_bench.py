"""Plots of launch/bench/bench_kernel.py's results: TFLOP/s against S, one line per provider; prints the
markdown table (bench_kernel.markdown_table) of the same records for docs/performance.md.

    PYTHONPATH=. python3 launch/bench/plot_kernel_bench.py             # the latest run that spans several S
    PYTHONPATH=. python3 launch/bench/plot_kernel_bench.py --run 3 4   # runs that measured different cells

One PNG per (D, Hkv), named after the JSON (docs/benchmarks/kernel_h200_d128_hkv32.png, ...),
written beside it unless --out-dir says otherwise; subplots per (causal, mode). A run with a
single S (bench_kernel.py --long) has no curve: plot it only by naming it. Ratios only hold
within one run, so runs drawn together must not share a cell (D, Hkv, causal, S, mode): every
point of the plots and row of the table then compares providers of one run (a grid too long for
one GPU command is run in parts, one run each).
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)
from bench_kernel import PROVIDERS, markdown_table, read_results  # noqa: E402


def latest_curve_run(records: list[dict]) -> int:
    """The highest run label whose timed records span more than one sequence length."""
    lengths: dict[int, set] = {}
    for r in records:
        if "tflops" in r:
            lengths.setdefault(r["run"], set()).add(r["S"])
    return max(run for run, seqlens in lengths.items() if len(seqlens) > 1)


def plot(records: list[dict], title: str, out_stem: Path) -> list[Path]:
    """One figure per (D, Hkv) of the timed records, subplots (causal, mode); returns the PNG paths."""
    timed = [r for r in records if "tflops" in r]
    paths = []
    for head_dim, heads_k in sorted({(r["D"], r["Hkv"]) for r in timed}):
        cell = [r for r in timed if (r["D"], r["Hkv"]) == (head_dim, heads_k)]
        causals = sorted({r["causal"] for r in cell})
        modes = sorted({r["mode"] for r in cell}, key=["fwd", "fwd+bwd"].index)
        fig, axes = plt.subplots(len(causals), len(modes), figsize=(5 * len(modes), 3.6 * len(causals)),
                                 sharex=True, sharey=True, squeeze=False)  # fmt: skip
        for ax, (causal, mode) in zip(axes.flat, [(c, m) for c in causals for m in modes], strict=True):
            sub = [r for r in cell if (r["causal"], r["mode"]) == (causal, mode)]
            for provider in sorted({r["provider"] for r in sub}, key=list(PROVIDERS).index):
                points = sorted((r["S"], r["tflops"]) for r in sub if r["provider"] == provider)
                ax.plot(*zip(*points, strict=True), marker="o", label=provider)
            seqlens = sorted({r["S"] for r in sub})
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
            ax.set_ylim(bottom=0)
            ax.set_title(f"{'causal' if causal else 'non-causal'}, {mode}")
            ax.set_xlabel("S")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small", loc="lower right")
            ax.label_outer()
        fig.suptitle(f"{title}, D = {head_dim}, Hkv = {heads_k}")
        fig.tight_layout()
        path = out_stem.with_name(f"{out_stem.name}_d{head_dim}_hkv{heads_k}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("docs/benchmarks/kernel_h200.json"))
    parser.add_argument("--run", type=int, nargs="+", default=None,
                        help="run labels (default: the latest run spanning several S)")  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=None, help="default: the JSON's folder")
    args = parser.parse_args()

    env, records = read_results(args.json)
    runs = args.run or [latest_curve_run(records)]
    if missing := [run for run in runs if str(run) not in env["runs"]]:
        parser.error(f"no run {missing[0]} in {args.json} (runs: {', '.join(env['runs'])})")
    records = [r for r in records if r["run"] in runs]
    owners: dict[tuple, set] = {}
    for r in records:
        if "tflops" in r:
            owners.setdefault((r["D"], r["Hkv"], r["causal"], r["S"], r["mode"]), set()).add(r["run"])
    if shared := sorted(cell for cell, owner in owners.items() if len(owner) > 1):
        parser.error(f"runs {sorted(owners[shared[0]])} both measured (D, Hkv, causal, S, mode) = {shared[0]}")
    title = (
        f"{env['gpu']}, {env['dtype']}, H = {records[0]['H']}, run{'s' * (len(runs) > 1)} {', '.join(map(str, runs))}"
    )
    out_dir = args.out_dir or args.json.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    out_stem = out_dir / args.json.stem
    for path in plot(records, title, out_stem):
        print(f"wrote {path}")
    print()
    for run in runs:
        print(f"Run {run} (`{env['runs'][str(run)]}`)")
    print()
    print(markdown_table(records))


if __name__ == "__main__":
    main()
