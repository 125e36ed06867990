"""tools/run_summary.py: the two lines the demo launchers print after training."""

import pytest

from fixtures_models import load_tool

run_summary = load_tool("run_summary")


def test_the_summary_gives_first_and_last_ten_rewards_and_the_eval_curve():
    rows = [{"step": 0, "eval/step": 0.0, "eval/avg@4": 0.25, "eval/pass@4": 0.5}]
    rows += [{"step": step, "reward/mean": step / 20} for step in range(1, 21)]
    rows += [{"step": 20, "eval/step": 20.0, "eval/avg@4": 0.75, "eval/pass@4": 1.0}]
    lines = run_summary.summarize("demo", rows, 12.4)
    first, last = sum(range(1, 11)) / 200, sum(range(11, 21)) / 200
    assert lines == [f"[demo] 20 steps in 12s (after set-up); reward/mean first 10 steps {first:.3f} -> last 10 "
                     f"steps {last:.3f} (rise {last - first:+.3f})",
                     "[demo] held-out eval/avg@4 by step: 0: 0.250, 20: 0.750"]


def test_a_run_without_eval_prints_one_line_and_one_without_rewards_stops():
    assert len(run_summary.summarize("demo", [{"step": 1, "reward/mean": 0.5}], 1.0)) == 1
    with pytest.raises(SystemExit, match=r"\[demo\] no step had a reward"):
        run_summary.summarize("demo", [{"step": 0, "eval/step": 0.0, "eval/avg@4": 0.1}], 1.0)


def test_with_group_filtering_the_summary_adds_the_reward_of_every_rollout():
    rows = [{"step": step, "reward/mean": 0.5, "reward/scored_mean": step / 20, "rollout/filtered_all_high": 1.0}
            for step in range(1, 21)]
    lines = run_summary.summarize("demo", rows, 1.0)
    assert lines[1] == "[demo] reward of every rollout (filtered groups too) first 10 steps 0.275 -> last 10 steps " \
                       "0.775 (rise +0.500)"
    # Without filtering the two rewards are the same number: one line.
    assert len(run_summary.summarize("demo", [{"step": 1, "reward/mean": 0.5, "reward/scored_mean": 0.5}], 1.0)) == 1
