"""Teacher-forcing parity with OpenVINO (bench/openvino_parity.py): the comparison arithmetic on made-up logits, the
CLI's refusals; and, in the slow tier, the embedded model's logits against OpenVINO's plain model on its export, in
float32 (the goal met) and bfloat16 (the goal missed: measured on docs/results/2026-12-06-openvino-parity.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from bench import openvino_parity as par
from replica.backends import openvino as ovb
from scissorhands.models import load_model
from workloads.quality.perplexity import heldout_windows

PEER_SITE = Path(__file__).resolve().parents[2] / ".cache" / "venv-openvino" / "lib" / "python3.11" / "site-packages"


def test_compare_logits_counts_top1_agreement_and_how_near_a_tie_each_disagreement_was():
    ours = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.9], [1.0, 0.0, 5.0], [0.5, 0.6, 0.0]])
    peer = torch.tensor([[2.5, 1.0, 0.0], [0.0, 1.9, 2.0], [1.0, 0.0, 4.0], [0.7, 0.6, 0.0]])
    r = par.compare_logits(ours, peer)
    assert r["positions"] == 4 and r["top1_disagreements"] == 2 and r["top1_agreement"] == 0.5
    assert r["max_abs_logit_diff"] == pytest.approx(1.0)  # position 2, token 2
    assert r["max_top2_margin_at_disagreement"] == pytest.approx(0.1)  # gaps 0.1 and 0.1 (ours) at positions 1, 3


def test_compare_logits_of_identical_logits_agrees_everywhere_and_has_no_disagreement_margin():
    x = torch.randn(7, 11, generator=torch.Generator().manual_seed(0))
    r = par.compare_logits(x, x.clone())
    assert (r["top1_agreement"], r["top1_disagreements"], r["max_abs_logit_diff"]) == (1.0, 0, 0.0)
    assert r["max_top2_margin_at_disagreement"] is None


@pytest.mark.parametrize("shapes", [((3, 5), (3, 6)), ((3, 5), (4, 5)), ((2, 3, 5), (2, 3, 5))])
def test_compare_logits_refuses_shapes_that_are_not_one_text_of_positions_by_vocab(shapes):
    a, b = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=r"logits: expected two \[positions, vocab\]"):
        par.compare_logits(a, b)


def test_an_unsupported_dtype_is_refused_naming_the_accepted_ones():
    with pytest.raises(ValueError, match="dtype: torch.float16; accepted: float32, bfloat16"):
        par.openvino_model(torch.float16, 1)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtypes", "float16"], "--dtypes: 'float16'; valid: float32, bfloat16"),
        (["--windows", "0"], "--windows: expected an integer >= 1, got 0"),
        (["--tokens", "0"], "--tokens: expected an integer >= 1, got 0"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        par.main(argv)
    assert err.value.code == 2 and message in capsys.readouterr().err


def test_without_the_export_the_tool_exits_2_naming_the_make_target(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(par, "runtime", lambda: None)
    monkeypatch.setattr(par, "EXPORT_DIR", tmp_path)
    assert par.main(["--windows", "1"]) == 2
    err = capsys.readouterr().err
    assert "make openvino-peer" in err and "openvino_model.xml" in err


# ---------------------------------------------------------------------------------------------- the real model
def _real_runtime_or_skip() -> None:
    """The runtime in this Python, else the peer venv's (appended after ours); skip when neither, or no export."""
    try:
        import openvino  # noqa: F401
    except ImportError:
        if not (PEER_SITE / "openvino").is_dir():
            pytest.skip("no openvino runtime (make openvino-runtime or make openvino-peer)")
        sys.path.append(str(PEER_SITE))
    if not (ovb.EXPORT_DIR / "openvino_model.xml").is_file():
        pytest.skip(f"no export at {ovb.EXPORT_DIR} (make openvino-peer)")


@pytest.fixture(scope="module")
def parity():
    """``dtype name -> teacher_forcing_parity`` on 8 held-out windows of 256 tokens (2,048 positions), 1 thread."""
    _real_runtime_or_skip()
    torch.set_num_threads(1)
    out = {}
    for name, dtype in par.DTYPES.items():
        model, tok = load_model("embedded", dtype=dtype, device="cpu")
        windows = [w[:-1] for w in heldout_windows(tok, 256, 8, 0)]
        out[name] = par.teacher_forcing_parity(model, windows, threads=1)
    return out


@pytest.mark.slow
def test_float32_logits_are_openvinos_to_float_rounding_and_every_top1_token_agrees(parity):
    """Measured: 2,048 of 2,048 positions agree, max |logit diff| 1.2e-4."""
    r = parity["float32"]
    assert r["positions"] == 2048 and r["openvino_precision"] == "f32"
    assert r["top1_agreement"] >= par.GOAL_TOP1 and r["top1_disagreements"] == 0
    assert r["max_abs_logit_diff"] < 1e-3


@pytest.mark.slow
def test_bfloat16_disagreements_are_all_near_ties(parity):
    """Measured: 74 of 2,048 positions differ (96.4%), each where our top-2 logits are within 0.19 of each other;
    max |logit diff| 1.8 (bf16 rounds the activations: our bf16 model departs from our f32 one as often)."""
    r = parity["bfloat16"]
    assert r["openvino_precision"] == "bf16"
    assert 0.95 <= r["top1_agreement"] < 1.0
    assert r["max_top2_margin_at_disagreement"] < 0.5


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="the 99% goal in bf16 is missed (96.4%; near-ties under bf16 rounding, "
    "docs/results/2026-12-06-openvino-parity.md); a pass means the page and this mark are out of date",
)
def test_bfloat16_top1_agreement_meets_the_99_percent_goal(parity):
    assert parity["bfloat16"]["top1_agreement"] >= par.GOAL_TOP1


def test_the_longest_window_is_one_less_than_the_longest_speech_and_at_most_the_context():
    assert par.max_window_tokens(100, None) == 99 and par.max_window_tokens(100, 8192) == 99
    assert par.max_window_tokens(25_441, 8192) == 8192


def test_tokens_past_the_longest_window_exit_2_naming_the_flag_and_its_range_and_the_longest_passes(
    monkeypatch, capsys
):
    with pytest.raises(SystemExit) as err:
        par.main(["--tokens", "100000", "--windows", "1", "--dtypes", "float32"])
    msg = capsys.readouterr().err
    assert err.value.code == 2 and "--tokens: expected an integer in [1, 8192]" in msg and "got 100000" in msg
    with pytest.raises(SystemExit) as err:
        par.main(["--tokens", "8193", "--windows", "1", "--dtypes", "float32"])
    assert err.value.code == 2 and "got 8193" in capsys.readouterr().err

    def absent():
        raise ovb.BackendUnavailable("no runtime here")

    monkeypatch.setattr(par, "runtime", absent)  # past the flag checks: the next refusal is the runtime's
    assert par.main(["--tokens", "8192", "--windows", "1", "--dtypes", "float32"]) == 2
    assert "openvino_parity: no runtime here" in capsys.readouterr().err
