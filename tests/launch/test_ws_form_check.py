"""launch/ws_form_check.py on the CPU (the interpreter): its list of forms, that it allows one form at a time and
sees it taken, and that it tells a right form from a wrong one."""

import sys
from pathlib import Path

import torch

from ringattn.ops import warp_spec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch"))
import ws_form_check  # noqa: E402 (a script beside the package, found through launch/)

CPU = torch.device("cpu")


def test_forms_are_every_name_the_kernels_have():
    """3 forward, 8 dK/dV and 6 dQ forms (each causal or not), the checked ones among them."""
    forms = warp_spec.WS_FORMS
    assert len(forms) == len(set(forms)) == 2 * (3 + 4 + 3)
    assert warp_spec.CHECKED_FORMS <= set(forms)
    assert {"fwd causal merge", "dkdv causal gqa fp32", "dq accumulate"} <= set(forms)


def test_only_form_allows_one_form_and_restores():
    allowed = warp_spec.ws_allowed
    with ws_form_check.only_form("dq causal") as taken:
        assert warp_spec.ws_allowed("dq causal", CPU, 64) and not warp_spec.ws_allowed("dq", CPU, 64)
        assert taken == {"dq causal"}
    assert warp_spec.ws_allowed is allowed


def test_a_right_form_passes_and_a_wrong_one_does_not(monkeypatch):
    """GQA dK/dV in the interpreter: every case right and taken; with dk off by 1e-3 of its size, every case
    wrong, and the verdict says so."""
    args = (["dkdv gqa"], [(68, 100)], [64], torch.float32, CPU, lambda line: None)
    records = ws_form_check.check_forms(*args)
    assert len(records) == 2 and all(r["ok"] and r["taken"] and r["same_bits"] for r in records)
    assert ws_form_check.verdicts(records) == {"dkdv gqa": True}

    real_bwd = ws_form_check.attn_bwd

    def off(*a, **kw):
        dq, dk, dv = real_bwd(*a, **kw)
        return dq, dk + 1e-3 * dk.abs().max(), dv

    monkeypatch.setattr(ws_form_check, "attn_bwd", off)
    records = ws_form_check.check_forms(*args)
    assert not any(r["ok"] for r in records) and "dk: max abs error" in records[0]["errors"]["dk"]
    assert ws_form_check.verdicts(records) == {"dkdv gqa": False}
