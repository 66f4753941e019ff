"""examples/train_hf_trainer.py: bad arguments are usage errors naming them, before any rank starts."""

import sys
from pathlib import Path

import pytest

from tests.utils import load_script

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--dim", "1024", "--heads", "2"], "--dim / --heads must be a multiple of 8 from 8 to 256"),
        (["--dim", "64", "--heads", "4", "--kv-heads", "3"], "--heads must be a multiple of --kv-heads"),
        (["--cp", "3"], "--cp 3 must divide the number of ranks, 2"),
    ],
    ids=["head-dim-512", "kv-heads", "cp"],
)
def test_bad_arguments_are_named(argv, message, capsys, monkeypatch):
    """Regression: a head dim of 512 passed the check and failed inside the first training step."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", ["train_hf_trainer.py", *argv])
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # the script imports train_gpt beside it
    with pytest.raises(SystemExit) as exc:
        load_script("examples/train_hf_trainer.py").parse_args(2, False)
    assert exc.value.code == 2 and message in capsys.readouterr().err
