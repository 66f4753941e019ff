"""launch/tools/compare_trees.py on the CPU: its table of two trees' times, with the spread of the rounds' ratios."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "launch" / "tools"))
import compare_trees  # noqa: E402 (a script beside the package, found through launch/tools/)

CELL = dict(D=128, S=4096, H=32, Hkv=8, causal=True, softcap=0.0, mode="fwd")


def _records(times: dict[str, list[float]], **cell) -> list[dict]:
    return [
        dict(CELL, **cell, tree=tree, round=r, ms=ms) for tree, rounds in times.items() for r, ms in enumerate(rounds)
    ]


def test_the_table_gives_the_medians_ratio_and_the_rounds_spread():
    records = _records({"main": [10.0, 12.0, 11.0], "change": [9.0, 12.6, 10.8]})
    records += _records({"main": [5.0, 5.0, 5.0], "change": [5.0, 5.0, 5.0]}, mode="fwd+bwd")
    lines = compare_trees.table(records, ("main", "change")).splitlines()
    assert lines[0].endswith("| main ms | change ms | change / main | rounds' change / main |")
    rows = {line.split(" | ")[5]: line for line in lines[2:]}
    # medians 11.0 and 10.8; the rounds' own ratios 0.9, 1.05, 0.982
    assert rows["fwd"] == "| 128 | 4096 | 8 | True | 0.0 | fwd | 11.000 | 10.800 | 0.982 | 0.900 to 1.050 |"
    assert rows["fwd+bwd"].endswith("| 5.000 | 5.000 | 1.000 | 1.000 to 1.000 |")
    assert len(lines) == 4
