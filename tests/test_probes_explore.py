"""`vit22b explore`: attention entropy against the query/key weight scale, QK-norm off and on."""

import json

import numpy as np
import pytest
from vit22b.clients.cli import main
from vit22b.probes.explore import DEFAULT_SCALES, explore, format_table, variant_name


@pytest.fixture(scope="module")
def report():
    return explore()  # scales 1/4 .. 32, doubling


@pytest.mark.parametrize("block", ["parallel", "sequential"])
def test_without_qk_norm_entropy_falls_toward_zero(report, block):
    rows = report["variants"][variant_name(block, qk_norm=False)]
    entropy = [r["entropy"] for r in rows]
    at_one = entropy[report["scales"].index(1.0)]
    assert at_one > 0.5 * report["uniform_entropy"]  # a spread-out head to begin with
    assert all(a > b for a, b in zip(entropy, entropy[1:]))  # falls with every doubling
    assert entropy[-1] < 0.01 * report["uniform_entropy"]  # ... to nearly one-hot attention
    logits = [r["max_logit"] for r in rows]
    assert logits[-1] > 100 * logits[report["scales"].index(1.0)]  # logits grow as scale**2


@pytest.mark.parametrize("block", ["parallel", "sequential"])
def test_with_qk_norm_entropy_stays_within_ten_percent(report, block):
    rows = report["variants"][variant_name(block, qk_norm=True)]
    at_one = rows[report["scales"].index(1.0)]["entropy"]
    for row in rows:
        assert abs(row["entropy"] - at_one) <= 0.1 * at_one, row


def test_explore_command_prints_the_table_and_writes_json_and_png(tmp_path, capsys):
    assert main(["explore", "--out", str(tmp_path)]) == 0  # same sweep: compiled already
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / "explore.json").read_text())
    assert saved["scales"] == list(DEFAULT_SCALES) and saved["tokens"] == 8
    assert format_table(saved) in out
    assert set(saved["variants"]) == {
        "parallel/qk_norm=off", "parallel/qk_norm=on",
        "sequential/qk_norm=off", "sequential/qk_norm=on",
    }  # fmt: skip
    assert saved["uniform_entropy"] == pytest.approx(np.log(8))
    assert (tmp_path / "entropy_vs_scale.png").stat().st_size > 1000


def test_explore_command_refuses_bad_arguments(tmp_path, capsys):
    # NaN and inf scales ended in matplotlib's traceback; 10^8 tokens or width in an
    # out-of-memory traceback (a 16 TB attention map); 1e20 overflowed float32 in the QK-norm
    # (a uniform entropy reported), 1e308 in matplotlib's log axis
    for argv in (["--scales", "0,1"], ["--scales", "nan"], ["--scales", "inf"],
                 ["--tokens", "100000000"], ["--width", "100000000"], ["--tokens", "1"],
                 ["--scales", ",".join(["1"] * 33)], ["--scales", "1e20"],
                 ["--scales", "1,1e308"]):
        assert main(["explore", *argv, "--out", str(tmp_path)]) == 2
        assert "--scales in (0, 10000]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["explore", "--scales", "one,two"])


def test_the_help_states_the_default_scales(capsys):
    # said in words by the command line, which does not import the explorer (jax) for --help
    with pytest.raises(SystemExit):
        main(["explore", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"default: {DEFAULT_SCALES[0]:g} to {DEFAULT_SCALES[-1]:g}, by factors of 2" in text
    assert all(b == 2 * a for a, b in zip(DEFAULT_SCALES, DEFAULT_SCALES[1:]))
