"""Plots of launch/bench/bench_kernel.py's record (TFLOP/s against S, a line per provider) and its markdown table.

The table (bench_kernel.markdown_table) is the one docs/performance.md shows.

    PYTHONPATH=. python3 launch/bench/plot_kernel_bench.py                                  # kernel_h200.json
    PYTHONPATH=. python3 launch/bench/plot_kernel_bench.py --json /tmp/k.json --out-dir /tmp

Reads {"environment", "records", "errors"} (bench_kernel.py's docstring). One PNG per (D, Hkv) measured at two or
more S (a single S draws no curve, and the script says so), named after the JSON
(docs/benchmarks/kernel_h200_d128_hkv32.png, ...), written beside it unless --out-dir says otherwise; subplots per
(causal, mode). Curves hold the grid's cells (B * S = the environment's tokens); a cell of another size
(bench_kernel.py --long) is in the table only. The errors are listed after the table.
"""

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)
from bench_kernel import MODES, NO_WINDOW, PROVIDERS, cell_key, markdown_table, read_results  # noqa: E402 (beside)


def plot(records: list[dict], title: str, out_stem: Path) -> list[Path]:
    """One figure per (D, Hkv) of `records`, subplots (causal, mode), a line per provider; returns the PNG paths.
    A (D, Hkv) whose records span a single S gets no figure."""
    paths = []
    for head_dim, heads_k in sorted({(r["D"], r["Hkv"]) for r in records}, key=lambda c: (c[0], -c[1])):
        cell = [r for r in records if (r["D"], r["Hkv"]) == (head_dim, heads_k)]
        if len({r["S"] for r in cell}) < 2:
            continue
        causals = sorted({r["causal"] for r in cell})
        modes = sorted({r["mode"] for r in cell}, key=MODES.index)
        fig, axes = plt.subplots(len(causals), len(modes), figsize=(5 * len(modes), 3.6 * len(causals)),
                                 sharex=True, sharey=True, squeeze=False)  # fmt: skip
        for ax, (causal, mode) in zip(axes.flat, [(c, m) for c in causals for m in modes], strict=True):
            sub = [r for r in cell if (r["causal"], r["mode"]) == (causal, mode)]
            for provider in sorted({r["provider"] for r in sub}, key=PROVIDERS.index):
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("docs/benchmarks/kernel_h200.json"))
    parser.add_argument("--out-dir", type=Path, default=None, help="default: the JSON's folder")
    args = parser.parse_args(argv)

    env, records, errors = read_results(args.json)
    plain = [r for r in records if cell_key(r)[-3:-1] == (tuple(NO_WINDOW), 0.0)]  # no window, no soft-cap
    grid = [r for r in plain if r["B"] * r["S"] == env["tokens"]]
    title = f"{env['gpu']}, {env['dtype']}, H = {env.get('heads', records[0]['H'] if records else '?')}"
    out_dir = args.out_dir or args.json.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = plot(grid, title, out_dir / args.json.stem)
    for path in paths:
        print(f"wrote {path}")
    if len(paths) < len({(r["D"], r["Hkv"]) for r in grid}):
        print("no figure for a (D, Hkv) measured at a single S")
    print()
    for command in env.get("commands", []):
        print(f"`bench_kernel.py {command}`")
    print()
    print(markdown_table(records))
    if errors:
        print()
        for e in errors:
            print(f"- {e['provider']} B={e['B']} S={e['S']} Hkv={e['Hkv']} D={e['D']} causal={e['causal']} "
                  f"{e['mode']}: {e['error']}")  # fmt: skip


if __name__ == "__main__":
    main()
