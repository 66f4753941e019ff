"""launch/ring_check.py's options: bad values are usage errors (status 2) naming the option, before any rank
starts."""

import sys

import pytest

from tests.utils import load_script


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--head-dim", "0"], "--head-dim 0 must be a multiple of 8 from 8 to 256"),
        (["--head-dim", "512"], "--head-dim 512 must be a multiple of 8 from 8 to 256"),
        (["--heads", "65536", "--kv-heads", "1"], "--heads 65536 must be a positive multiple of --kv-heads 1, at most"),
        (["--batch", "0"], "--batch 0 must be from 1 to 65535"),
    ],
    ids=["head-dim-0", "head-dim-512", "heads", "batch"],
)
def test_ring_check_bad_arguments_are_named(argv, message, capsys, monkeypatch):
    """Regression: --head-dim 0 divided by zero, -8 made a tensor of negative size, 512 and --heads 65536 failed
    inside the ring; each is now a usage error naming the option."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", ["ring_check.py", *argv])
    with pytest.raises(SystemExit) as exc:
        load_script("launch/ring_check.py").parse_args(2, False)
    assert exc.value.code == 2 and message in capsys.readouterr().err
