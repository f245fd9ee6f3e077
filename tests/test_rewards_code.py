"""Code reward: extraction, output comparison, reward modes, call-based harness."""
import concurrent.futures as cf

import pytest

from klear_jax.rewards import (CodeRewardConfig, CodeScorer, SandboxConfig, SandboxUnavailable,
                               code_reward, extract_code)
from klear_jax.rewards.code import call_matches, pass_to_reward, stdout_matches

SBX = SandboxConfig(timeout_s=3.0, num_slots=2)
DOUBLE = {"inputs": ["1\n", "2\n", "3\n", "4\n"], "outputs": ["2\n", "4\n", "6\n", "9\n"]}


def resp(code, think=True):
    return ("<think>plan</think>\n" if think else "") + f"Here:\n```python\n{code}\n```\n"


@pytest.fixture(scope="module")
def scorer():
    with CodeScorer(CodeRewardConfig(sandbox=SBX)) as s:
        yield s


def test_extract_last_block_after_think():
    r = ("<think>```python\nprint('draft')\n```</think>\n```python\nprint(1)\n```\n"
         "text\n```py\nprint(2)\n```\n```text\nnot code\n```")
    assert extract_code(r) == "print(2)\n"
    assert extract_code("<think>```python\nprint(1)\n```</think> none") is None


def test_stdout_normalisation():
    assert stdout_matches("1 2  \n3\n\n", "1 2\n3")
    assert stdout_matches("1   2\n", "1 2\n")
    assert stdout_matches("1.0 2.50\n", "1 2.5")          # decimal-equal numbers (LCB)
    assert not stdout_matches("1 2\n", "1 2 3")
    assert not stdout_matches("1\n2\n", "1 2")
    assert not stdout_matches("YES", "yes")


def test_call_matches_plain_json_only():
    assert call_matches([1, 2], [1, 2]) and call_matches([1, 2], [[1, 2]])
    assert call_matches(0.1 + 0.2, 0.3) and not call_matches(True, 1)
    assert not call_matches("1", 1) and not call_matches([1], [1, 2])


def test_reward_modes():
    assert pass_to_reward(3, 4, "soft") == 0.75
    assert pass_to_reward(3, 4, "two_p_minus_one") == 0.5
    assert pass_to_reward(3, 4, "all_or_nothing") == 0.0
    assert pass_to_reward(4, 4, "all_or_nothing") == 1.0
    with pytest.raises(ValueError, match="mode"):
        CodeRewardConfig(mode="hard")


def test_stdio_problem_partial_credit(scorer):
    good = resp("n = int(input())\nprint(2 * n)")
    crash = resp("raise SystemExit(1)")
    got = scorer.score_batch([good, crash, resp("print(2*int(input()), end='')")], [DOUBLE] * 3)
    assert got == [0.75, 0.0, 0.75]


def test_format_penalties(scorer):
    assert scorer.score_batch(["<think>x</think> no code", resp("print(1)", think=False),
                               "<think>never closed ```python\nprint(1)\n```"],
                              [DOUBLE] * 3) == [-1.0, -2.0, -0.5]


def test_call_based_styles(scorer):
    fn = resp("def add(a, b):\n    print('debug', a)\n    return a + b")
    cls = resp("class Solution:\n    def add(self, a, b):\n        return (a + b, a - b)")
    tests_fn = {"fn_name": "add", "inputs": [[1, 2], "[1, 2]\n[3]", [0, 0]],
                "outputs": [3, "[1, 2, 3]", [1]]}
    tests_cls = {"fn_name": "add", "inputs": [[5, 3], [1, 1]], "outputs": [[[8, 2]], [2, 0]]}
    assert scorer.score_batch([fn, cls], [tests_fn, tests_cls]) == [pytest.approx(2 / 3), 1.0]


def test_max_tests_and_other_modes():
    tests = {"inputs": [f"{i}\n" for i in range(5)], "outputs": ["0\n"] * 5}
    prog = resp("print(0 if int(input()) < 1 else 1)")
    sb = SandboxConfig(timeout_s=3.0, num_slots=2, max_tests=2)
    assert code_reward(prog, tests, CodeRewardConfig(sandbox=sb)) == 0.5
    assert code_reward(prog, tests, CodeRewardConfig(sandbox=sb, mode="two_p_minus_one")) == 0.0
    assert code_reward(prog, tests, CodeRewardConfig(sandbox=sb, mode="all_or_nothing")) == 0.0


def test_submit_batch_returns_future(scorer):
    fut = scorer.submit_batch([resp("print(2*int(input()))")] * 3, [DOUBLE] * 3)
    assert isinstance(fut, cf.Future)
    assert fut.result(timeout=60) == [0.75] * 3


def test_dedupe_runs_identical_programs_once(monkeypatch):
    import klear_jax.rewards.code as code_mod
    calls = []
    real = code_mod._run_one

    def counting(sandbox, code, tests, i):
        calls.append((code, i))
        return real(sandbox, code, tests, i)

    monkeypatch.setattr(code_mod, "_run_one", counting)
    good, bad = resp("print(2*int(input()))"), resp("print(0)")
    other = {"inputs": ["5\n"], "outputs": ["10\n"]}
    batch = [good, bad, good, good, good]
    tests = [DOUBLE, DOUBLE, DOUBLE, DOUBLE, other]
    for dedupe, runs in ((False, 17), (True, 9)):  # 4 tests each; `other` has one test
        calls.clear()
        with CodeScorer(CodeRewardConfig(sandbox=SBX, dedupe=dedupe)) as s:
            assert s.score_batch(batch, tests) == [0.75, 0.0, 0.75, 0.75, 1.0]
        assert len(calls) == runs


def test_bad_tests_name_the_item(scorer):
    with pytest.raises(ValueError, match="batch item 1: .*2 inputs but 1 outputs"):
        scorer.score_batch(["a", "b"], [DOUBLE, {"inputs": [1, 2], "outputs": [1]}])


def test_missing_bwrap_refuses_unless_allowed(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="allow_unsandboxed=True"):
        CodeScorer(CodeRewardConfig(sandbox=SBX))
    cfg = CodeRewardConfig(sandbox=SandboxConfig(timeout_s=2.0, num_slots=1,
                                                 allow_unsandboxed=True))
    with CodeScorer(cfg) as s:
        assert s.sandbox.mode == "unsandboxed"
        assert s.score_batch([resp("print(2*int(input()))"), resp("while True: pass")],
                             [DOUBLE, DOUBLE]) == [0.75, 0.0]


def test_numbers_compare_exactly_and_never_raise():
    from klear_jax.rewards.code import _values_equal
    assert _values_equal(10 ** 30, 10 ** 30) and not _values_equal(10 ** 30, 10 ** 30 + 1)
    assert not _values_equal(10 ** 4000, 1.5) and not _values_equal(1.5, 10 ** 4000)
    assert _values_equal(3, 3.0) and not _values_equal(2 ** 53 + 1, 2 ** 53)   # no float trip
    for x in (float("nan"), float("inf"), float("-inf")):
        assert not _values_equal(x, x)
    assert not stdout_matches("sNaN", "1") and not stdout_matches("NaN", "nan")
    assert not stdout_matches("Infinity", "inf") and stdout_matches("sNaN", "sNaN")  # text
    assert stdout_matches("1e999999999", "1E+999999999")


def test_call_result_size_and_depth_capped():
    from klear_jax.rewards.code import MAX_DEPTH, _parse_call_output
    ok = _parse_call_output(b"n " + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, "n")
    assert ok[1] is None
    for line, why in ((b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "deeper"),
                      (b"[" * 100000 + b"]" * 100000, "RecursionError"),
                      (b"NaN", "non-finite"), (b"[Infinity]", "non-finite"),
                      (b"1" * 5000, "not plain JSON")):
        value, reason = _parse_call_output(b"n " + line, "n")
        assert value is None and why in reason, reason


def test_one_bad_sample_never_fails_the_batch(scorer):
    """Item 5: each pathological sample fails its test with a reason; the batch scores."""
    call = {"fn_name": "f", "inputs": [[1]], "outputs": [1.5]}
    batch = [
        (resp("def f(x):\n    return 10 ** 4000"), call),                       # huge int
        (resp("print('sNaN')"), {"inputs": [""], "outputs": ["1"]}),             # sNaN token
        (resp("import __main__, os\nos.write(1, (__main__._nonce + ' ' + '[' * 20000 + "
              "']' * 20000 + '\\n').encode())\nos._exit(0)"), call),             # deep JSON
        (resp("def f(x):\n    return float('inf')"), {**call, "outputs": [float("inf")]}),
        (resp("def f(x):\n    return 1"), {"fn_name": "f", "inputs": ["{not json"],
                                            "outputs": [1]}),                 # bad test data
        (resp("def f(x):\n    return 1.5"), call),                               # benign
    ]
    scores = scorer.score_batch_detailed([r for r, _ in batch], [t for _, t in batch])
    assert [s.reward for s in scores] == [0.0] * 5 + [1.0]
    reasons = [s.failures[0][1] for s in scores[:5]]
    assert reasons[0] == "wrong answer" and reasons[1] == "wrong answer"
    assert "RecursionError" in reasons[2] and "non-finite" in reasons[3]
    assert reasons[4].startswith("scoring error: ValueError") and "JSON value" in reasons[4]
    assert scores[5].failures == [] and scores[5].passed == scores[5].total == 1


def test_dev_stdout_and_dev_stderr_are_usable(scorer):
    """Item 6: the pipes belong to the program's uid, so reopening them works."""
    prog = resp("import sys\nn = int(input())\nopen('/dev/stderr', 'w').write('dbg\\n')\n"
                "with open('/dev/stdout', 'w') as f:\n    f.write(str(2 * n) + '\\n')")
    call = resp("def f(x):\n    open('/dev/stdout', 'w').write('debug\\n')\n    return x + 1")
    assert scorer.score_batch([prog, call], [DOUBLE, {"fn_name": "f", "inputs": [[1]],
                                                      "outputs": [2]}]) == [0.75, 1.0]
