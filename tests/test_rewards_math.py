"""Math reward: format penalties, math-verify equivalences, and the deadline pool."""
import time

import pytest

from klear_jax.rewards import MathRewardConfig, MathScorer, math_reward, math_reward_batch
from klear_jax.rewards.math import format_reward
from klear_jax.rewards.pool import DeadlinePool


def R(ans):
    return f"<think>working...</think>\nSo the final answer is $\\boxed{{{ans}}}$."


@pytest.fixture(scope="module")
def scorer():
    with MathScorer(MathRewardConfig(num_workers=2)) as s:
        yield s


def test_equivalent_forms_score_plus_one(scorer):
    cases = [("3/4", "\\frac{3}{4}"), ("0.75", "\\frac34"), ("\\frac{1}{2}", "0.5"),
             ("2\\sqrt{2}", "\\sqrt{8}"), ("x^2+1", "1+x^2"), ("\\boxed{12}", "12"),
             ("$-7$", "-7"), ("100", "100")]
    got = scorer.score_batch([R(p) for _, p in cases], [g for g, _ in cases])
    assert got == [1.0] * len(cases)


def test_wrong_or_missing_answer_scores_minus_one(scorer):
    got = scorer.score_batch([R("6"), R("\\frac{3}{5}"), "<think>a</think> I don't know",
                              "<think>a</think>"], ["5", "3/4", "2", "2"])
    assert got == [-1.0] * 4


def test_answer_only_counts_after_last_close_think(scorer):
    resp = "<think>maybe \\boxed{5}</think> no wait <think>hm</think> it is \\boxed{6}"
    assert scorer.score_batch([resp, resp], ["6", "5"]) == [1.0, -1.0]


def test_format_penalties_and_config():
    cfg = MathRewardConfig()
    assert format_reward("no tags \\boxed{1}", cfg) == -2.0
    assert format_reward("<think> never closed \\boxed{1}", cfg) == -0.5
    assert format_reward("<think>a</think>\\boxed{1}", cfg) is None
    qwen3 = MathRewardConfig(require_open_think=False, missing_close_think=-0.25)
    assert format_reward("reasoning</think>\\boxed{1}", qwen3) is None
    assert format_reward("reasoning \\boxed{1}", qwen3) == -0.25


def test_public_api_and_custom_values():
    assert math_reward(R("42"), "42") == 1.0
    assert math_reward("reasoning</think> \\boxed{42}", "42") == -2.0
    cfg = MathRewardConfig(correct=2.0, wrong=0.0, require_open_think=False)
    assert math_reward_batch(["x</think>\\boxed{42}", "x</think>\\boxed{41}"], ["42", "42"],
                             cfg) == [2.0, 0.0]


def test_batch_length_mismatch_names_both():
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        math_reward_batch(["a", "b"], ["1"])


def test_pool_kills_hung_item_and_keeps_working():
    with DeadlinePool("time:sleep", num_workers=2, deadline_s=0.5) as pool:
        t = time.monotonic()
        assert pool.map([(30,), (0,), (30,), (0,)], default="late") == ["late", None, "late", None]
        assert time.monotonic() - t < 10
        assert pool.stats["timeouts"] == 2
        assert pool.map([(0,)] * 3, default="late") == [None] * 3


def test_pool_survives_crashing_and_raising_items():
    with DeadlinePool("os:_exit", num_workers=1, deadline_s=5) as pool:
        assert pool.map([(1,), (1,)], default="dead") == ["dead", "dead"]
        assert pool.stats["crashes"] == 2
    with DeadlinePool("math:sqrt", num_workers=1, deadline_s=5) as pool:
        assert pool.map([(4,), (-1,), (9,)], default=None) == [2.0, None, 3.0]
        assert pool.stats["errors"] == 1


def test_pool_rejects_bad_function_name():
    with pytest.raises(AttributeError):
        DeadlinePool("os:no_such_function")


def test_pool_warms_workers_before_the_deadline_clock_runs(monkeypatch):
    """A function's ``worker_warm_up`` (math-verify's first call imports sympy) runs before
    the worker reports ready, so it never eats into the first item's deadline."""
    import os
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(__file__))
    with DeadlinePool("pool_helpers:is_warm", num_workers=1, deadline_s=0.5) as pool:
        assert pool.map([()], default="timed out") == [True]
        assert pool.stats["timeouts"] == 0
    from klear_jax.rewards.math import verify_answer
    assert callable(verify_answer.worker_warm_up)


def test_hostile_answers_run_in_parallel_and_logs_are_capped(capfd):
    """Answers that run math-verify into its timeouts: each ends inside its worker within
    the one budget (no worker killed), a batch of them spreads over the workers, and the
    warnings math-verify prints quote at most MAX_LOG_CHARS of the answer."""
    from klear_jax.rewards.math import MAX_LOG_CHARS
    hostile = R("x^" * 3000 + "2")                    # parsing runs into the alarm
    n, workers = 8, 4
    with MathScorer(MathRewardConfig(num_workers=workers, verify_timeout_s=1,
                                     deadline_s=20)) as s:
        assert s.score_batch([R("1")] * workers, ["1"] * workers) == [1.0] * workers
        t = time.monotonic()
        assert s.score_batch([hostile], ["2"]) == [-1.0]
        one = time.monotonic() - t
        t = time.monotonic()
        assert s.score_batch([hostile] * n + [R("2")], ["2"] * (n + 1)) == [-1.0] * n + [1.0]
        batch = time.monotonic() - t
        assert s.pool.stats["timeouts"] == 0 and s.pool.stats["crashes"] == 0
    assert one >= 0.9                                   # each hostile answer costs the budget
    assert batch < n * one / 2, (batch, one)            # ... but they overlap (4 workers)
    err = capfd.readouterr().err
    assert err.count("Timeout during parsing") >= n, err[-500:]
    assert err.count("Timeout during parsing") == err.count(" chars]"), err[-500:]
    assert max(map(len, err.splitlines())) < MAX_LOG_CHARS + 80 and len(err) < 2 * n * MAX_LOG_CHARS
