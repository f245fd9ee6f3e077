"""Host-side pieces of the RL loop: mixed math/code scoring, rollout and update metrics."""
import numpy as np
import pytest

from klear_jax import config as cu
from klear_jax.rewards.scorers import Scorers
from klear_jax.rl import metrics as rl
from klear_jax.rl.rollout import GroupScoring


def test_scorers_mixed_math_and_code_exact():
    cfg = cu.load_config("configs/gppo_tiny.py")
    records = [{"answer": "4", "tests": None, "source": "m"},
               {"answer": "", "tests": {"inputs": ["1\n", "5\n"], "outputs": ["2\n", "6\n"]},
                "source": "c"},
               {"answer": "", "tests": {"fn_name": "f", "inputs": [[1], [2]], "outputs": [2, 5]},
                "source": "c"}]
    texts = ["<think>2+2</think> \\boxed{4}", "<think>2+2</think> \\boxed{5}",
             "<think>x</think>\n```python\nprint(int(input()) + 1)\n```",
             "<think>x</think> no code here",
             "<think>x</think>\n```python\ndef f(x):\n    return 2 * x\n```",  # passes 1 of 2
             "no think at all"]
    scorers = Scorers(cu.math_reward_config(cfg), cu.code_reward_config(cfg))
    try:
        scoring = GroupScoring(scorers, records, 2, tokenizer=None)
        scoring.submit([5, 0, 3], [texts[i] for i in (5, 0, 3)])  # any order, any batches
        scoring.submit([1, 2, 4], [texts[i] for i in (1, 2, 4)])
        rewards, correct, adv = scoring.result()
    finally:
        scorers.close()
    np.testing.assert_allclose(rewards, [[1.0, -1.0], [1.0, -1.0], [0.5, -2.0]])
    np.testing.assert_array_equal(correct, [[True, False], [True, False], [False, False]])
    # GRPO per group: (r - mean) / (unbiased std + 1e-6)
    np.testing.assert_allclose(adv, [[0.7071, -0.7071]] * 3, atol=1e-4)
    assert scoring.groups_done == 3


def test_rollout_metrics_exact():
    records = [{"tests": None, "source": "gsm"}, {"tests": {"inputs": []}, "source": ""}]
    rewards = np.array([[1.0, -1.0], [0.5, 1.0]], np.float32)
    m = rl.rollout_metrics(records, rewards, rewards >= 1.0, np.array([3, 5, 7, 9]),
                           np.array([False, True, False, False]), np.array([True, True]),
                           kept=np.array([0]), batch_prompts=2)
    assert m["reward/mean"] == pytest.approx(0.375)
    assert m["reward/math_mean"] == 0.0 and m["reward/code_mean"] == 0.75
    assert m["reward/math_std"] == 1.0 and m["reward/code_std"] == 0.25
    assert m["accuracy"] == 0.5 and m["accuracy/math"] == 0.5 and m["accuracy/code"] == 0.5
    assert m["reward/source_gsm_mean"] == 0.0 and "reward/source__mean" not in m
    assert m["response/length_mean"] == 6.0 and m["response/length_max"] == 9.0
    assert m["response/truncation_rate"] == 0.25
    assert m["groups/signal_frac"] == 1.0 and m["groups/kept"] == 1.0
    assert m["groups/kept_frac"] == 0.5


def test_mean_update_metrics():
    ms = [{"loss": 1.0, "grad_norm": 2.0, "lr": 1e-6, "ratio_min": 0.9, "ratio_max": 1.1,
           "skipped": 0.0, "skipped_total": 0.0, "tokens": 10.0},
          {"loss": 3.0, "grad_norm": 4.0, "lr": 2e-6, "ratio_min": 0.8, "ratio_max": 1.05,
           "skipped": 1.0, "skipped_total": 1.0, "tokens": 0.0}]
    m = rl.mean_update_metrics(ms)
    assert m["train/loss"] == 2.0 and m["train/grad_norm"] == 3.0
    assert m["train/grad_norm_max"] == 4.0 and m["train/lr"] == 2e-6
    assert m["train/ratio_min"] == 0.8 and m["train/ratio_max"] == 1.1
    assert m["train/skipped"] == 1.0 and m["train/skipped_total"] == 1.0
    assert m["train/tokens"] == 10.0 and m["train/num_updates"] == 2.0
    assert rl.mean_update_metrics([]) == {"train/num_updates": 0.0}
