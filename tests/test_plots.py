"""The plot helpers (vpo.plots): plain k ticks, a sensible y-range for constant data, and a note when
lines coincide; and the evaluation plot uses them."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from vpo.plots import coinciding, coinciding_note, k_axis, learning_curves, y_range


def test_k_axis_has_plain_ticks_and_no_minor_labels() -> None:
    fig, ax = plt.subplots()
    ax.plot([1, 3, 5], [0.1, 0.2, 0.3])
    k_axis(ax, [1, 3, 5])
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "3", "5"]
    assert [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()] == []
    plt.close(fig)


def test_y_range_for_constant_and_mixed_values() -> None:
    lo, hi = y_range([0.448, 0.448, 0.448])  # matplotlib alone would show 0.43-0.47
    assert lo < 0 and hi > 0.448 and hi - lo > 0.4
    assert y_range([0.0, 0.0]) == (-0.05, 1.05)
    lo, hi = y_range([-0.2, 0.5])
    assert lo < -0.2 and hi > 0.5


def test_coinciding_groups_and_note() -> None:
    series = {"grpo": [0.1, 0.2], "grpo/best_of_k": [0.1, 0.2], "vpo": [0.1, 0.3], "x": [0.1, 0.3]}
    assert coinciding(series) == [["grpo", "grpo/best_of_k"], ["vpo", "x"]]
    assert coinciding_note(series) == "lines drawn on top of each other: grpo = grpo/best_of_k; vpo = x"
    assert coinciding_note({"a": [1.0], "b": [2.0]}) is None


def test_evaluation_plot_notes_coinciding_arms(tmp_path: Path, monkeypatch) -> None:
    """Two arms with identical curves: the best@k panel says so, its ticks are the ks."""
    from vpo.pipeline.stages import evaluate

    notes: list[str] = []
    real = matplotlib.axes.Axes.text

    def spy(self, x, y, s, *a, **kw):
        notes.append(s)
        return real(self, x, y, s, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "text", spy)
    curve = {k: {"mean": v, "std": 0.0, "min": v, "max": v} for k, v in (("1", 0.3), ("3", 0.4), ("5", 0.45))}
    other = {k: {"mean": v + 0.1, "std": 0.0, "min": v + 0.1, "max": v + 0.1} for k, v in (("1", 0.3), ("3", 0.4),
                                                                                         ("5", 0.45))}
    agg = {arm: {"runs": ["r"], "best_at_k": c, "expected_weighted_best_at_k": c, "pass_at_k": c}
           for arm, c in (("grpo", curve), ("grpo_x3", curve), ("vpo", other))}
    evaluate.plot_best_at_k(agg, [1, 3, 5], tmp_path / "p.png", "t")
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert notes.count("lines drawn on top of each other: grpo = grpo_x3") == 3


def test_learning_curves_average_seeds_per_step(tmp_path: Path) -> None:
    """Each arm's line is the mean over its runs of the smoothed logged values, at the steps every run
    logged; runs without a key draw nothing for it."""
    def run(offset: float, steps: range) -> list[dict[str, float]]:
        return [{"step": s, "reward": offset + 0.01 * s, "vpo/expected_max": 0.5} for s in steps]

    histories = {"vpo": [run(0.0, range(1, 11)), run(0.2, range(1, 13))], "grpo": [run(0.5, range(1, 11))]}
    drawn = learning_curves(histories, tmp_path / "lc.png", "t", smooth=2)
    assert (tmp_path / "lc.png").stat().st_size > 1000
    steps, means = drawn["reward"]["vpo"]
    assert steps == list(range(2, 11))  # steps both runs logged, minus the first (2-point moving average)
    assert means[0] == pytest.approx(0.1 + 0.015)  # mean of the two runs' (s=1, s=2) averages
    assert drawn["vpo/expected_max"]["grpo"][1] == [0.5] * 9
    assert "vpo/frac_unparsed" not in drawn
