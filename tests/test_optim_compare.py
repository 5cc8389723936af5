"""`python -m bigdense.bench.optim_compare` end to end at a toy size: with one LR there is no sweep,
the final pair is AdamW then Muon, each the real `launch/train.py` with the forwarded overrides, the
JSON and the figure are written, and the same command again reads the finished runs back."""
import json
import math

import pytest

from bigdense.bench import optim_compare

@pytest.mark.slow  # two launches of launch/train.py: about 20 s on 2 busy cores
def test_the_pair_trains_and_the_report_is_written(tmp_path, small):
    out, figure = tmp_path / "runs.json", tmp_path / "pair.svg"
    optim_compare.main(["--steps", "4", "--lrs", "1e-3", "--run-root", str(tmp_path / "runs"),
                        "--json", str(out), "--figure", str(figure), "--", *small])
    runs = json.loads(out.read_text())["runs"]
    assert [(r["stage"], r["optimizer"], r["lr"], r["steps"]) for r in runs] == [
        ("final", "adamw", 1e-3, 4), ("final", "muon", 1e-3, 4)]
    for r in runs:
        assert r["returncode"] == 0, r["run_dir"]
        assert math.isfinite(r["held_out_loss"]) and math.isfinite(r["ms_per_step"]), r
        assert r["curve"][-1][0] == 4, r["curve"]
        assert "optim=" + r["optimizer"] in r["command"]
    text = figure.read_text()
    assert text.startswith("<?xml") and "held-out loss" in text and "Muon, lr 0.001" in text

    # The same command again: both runs are finished there, so they are read, not trained again.
    again = optim_compare.main(["--steps", "4", "--lrs", "1e-3", "--run-root", str(tmp_path / "runs"), "--", *small])
    assert [(r["reused"], r["held_out_loss"]) for r in again["runs"]] == [(True, r["held_out_loss"]) for r in runs]


def test_the_pick_is_the_lowest_finite_held_out_loss_and_the_smoothing_trails():
    runs = [{"optimizer": "adamw", "lr": lr, "held_out_loss": loss}
            for lr, loss in ((3e-4, 5.0), (1e-3, 4.5), (3e-3, float("nan")))]
    assert optim_compare.best_lr(runs, "adamw", [3e-4, 1e-3, 3e-3]) == 1e-3
    assert optim_compare.smooth([4.0, 2.0, 6.0, 0.0], 2) == [4.0, 3.0, 4.0, 3.0]
