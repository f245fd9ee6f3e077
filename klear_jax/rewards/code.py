"""Code reward: run the last ```python block after `</think>` against a problem's tests.

`tests` follows APPS/TACO `input_output`: {"inputs": [...], "outputs": [...]} runs the
program as a script (stdin -> stdout); adding "fn_name" makes it call-based: inputs[i]
is the list of arguments (or a string of one JSON value per line, LiveCodeBench style),
outputs[i] the return value (APPS also accepts outputs[i][0]).

Each test is one sandbox run (fresh interpreter, fresh namespaces): tests cannot leak
state into each other, a hang costs one test and the per-test deadline is enforced by the
trusted parent, not by anything inside the sandbox. At ~60 ms per run the overhead is
small beside the slot concurrency. The expected outputs never enter the sandbox, and
the trusted parent does all comparing:
- stdin/stdout: whitespace-normalised lines (trailing spaces and blank edge lines
  ignored); a line whose tokens are all numbers also matches when they are equal as
  decimals ("1.0" == "1"), as LiveCodeBench does.
- call-based: a small harness reads a per-run random nonce and the arguments from stdin
  before the model's code runs, keeps private references to json.dumps and os.write,
  calls the function, and writes one line "<nonce> <json result>". The parent accepts
  only that line, parses it as plain JSON and compares values, so a rigged __eq__,
  exiting early (sys.exit / os._exit), printing fake markers or patching print/json/exit
  cannot turn a failure into a pass: the child never sees what the right answer is.
  Ints compare exactly, floats within 1e-9; NaN / Infinity tokens fail; the result is
  at most `max_output_bytes` long and MAX_DEPTH deep.

Scoring never raises for one sample: whatever goes wrong with one test (the program, its
output, a huge or pathological value, even a malformed test) fails that test, and the
reason is kept in the sample's CodeScore (`score_batch_detailed`).

Reward (CodeRewardConfig.mode), p = fraction of the tests run that pass:
    "soft" (default, the paper's) -> p;  "two_p_minus_one" (their code) -> 2p - 1;
    "all_or_nothing" -> 1.0 if p == 1 else 0.0.
Tests run (CodeRewardConfig.test_selection): "first" `max_tests` (default), "random"
(`max_tests` drawn per response, as the authors' reward code does; seeded by test_seed), or
"all" (the official LiveCodeBench harness; `max_tests` ignored).
Format (same values and `think_check` as math, klear_jax.rewards.math.format_reward): no
`<think>` when required -> -2.0, no `</think>` -> -0.5, then no python block after
`</think>` (or anywhere, when there is none and think_check is "none") -> no_code (-1.0).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import decimal
import json
import math
import random
import re
import secrets
import threading

from klear_jax.rewards.math import check_think_check, format_problem
from klear_jax.rewards.pool import Closing, SharedPerConfig
from klear_jax.rewards.sandbox import Sandbox, SandboxConfig, SandboxUnavailable

_BLOCK = re.compile(r"```(?:python3?|py)[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)
MODES = ("soft", "two_p_minus_one", "all_or_nothing")
MAX_DEPTH = 100           # deepest list/dict a call-based result may be
MAX_REASON_CHARS = 200    # failure reasons kept in a CodeScore
TEST_SELECTIONS = ("first", "random", "all")


@dataclasses.dataclass(frozen=True)
class CodeRewardConfig:
    mode: str = "soft"
    no_code: float = -1.0
    missing_close_think: float = -0.5
    missing_open_think: float = -2.0
    require_open_think: bool = True
    think_check: str = "open_first"    # klear_jax.rewards.math.THINK_CHECKS
    test_selection: str = "first"      # TEST_SELECTIONS (module docstring)
    test_seed: int = 0                 # seeds the "random" draws of a scorer
    # Identical programs graded on identical tests within one batch run once and share the
    # result (sampled groups repeat programs often: the demo's held-out code samples at T=1.0
    # hold ~1/3 unique programs). Off by default: a program that draws random numbers then
    # gets one draw for all its copies.
    dedupe: bool = False
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"CodeRewardConfig.mode must be one of {MODES}, got {self.mode!r}")
        if self.test_selection not in TEST_SELECTIONS:
            raise ValueError(f"CodeRewardConfig.test_selection must be one of "
                             f"{TEST_SELECTIONS}, got {self.test_selection!r}")
        check_think_check(self)


def extract_code(response: str) -> str | None:
    """The last ```python block after the last `</think>` (None if there is none)."""
    blocks = _BLOCK.findall(response.rsplit("</think>", 1)[-1])
    return blocks[-1] if blocks else None


def _text(x) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def _lines(s: str) -> list[str]:
    return [ln.rstrip() for ln in s.strip().splitlines()]


def _num_tokens(line: str):
    """The line's tokens as finite Decimals, or None (NaN, sNaN, Infinity are not numbers
    here: they never compare equal)."""
    try:
        nums = [decimal.Decimal(t) for t in line.split()]
    except ArithmeticError:
        return None
    return nums if all(n.is_finite() for n in nums) else None


def stdout_matches(actual: str, expected: str) -> bool:
    a, e = _lines(actual), _lines(expected)
    if len(a) != len(e):
        return False
    for x, y in zip(a, e):
        if x.strip() == y.strip() or x.split() == y.split():
            continue
        nx, ny = _num_tokens(x), _num_tokens(y)
        if nx is None or ny is None or nx != ny:
            return False
    return True


def _values_equal(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int) and isinstance(b, int):
        return a == b                      # exact, however large
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if any(isinstance(x, float) and not math.isfinite(x) for x in (a, b)):
            return False                   # NaN / inf never equal
        if a == b:                         # int vs float: exact, no overflow
            return True
        try:
            return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
        except OverflowError:              # an int beyond float range is not close
            return False
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def call_matches(result, expected) -> bool:
    """APPS convention: equal to outputs[i], or to outputs[i][0] when that is a list."""
    if _values_equal(result, expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and _values_equal(result, expected[0])


def _parse_json_lines(x):
    if not isinstance(x, str):
        return x
    try:
        return [json.loads(line) for line in x.splitlines() if line.strip()]
    except ValueError as e:
        raise ValueError(f"call-based test input is not one JSON value per line: {x[:80]!r}") from e


def _parse_expected(x):
    if isinstance(x, str):
        try:
            return json.loads(x)
        except ValueError:
            return x
    return x


# The harness runs BEFORE the model's code; everything it needs is bound locally first.
_HARNESS = r'''
import sys, os, json
_write, _dumps, _fd, _exit = os.write, json.dumps, os.dup(1), os._exit
_nonce = sys.stdin.readline().strip()
_args = json.loads(sys.stdin.readline())
sys.stdin = open(os.devnull)
_src = %(src)r
_ns = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(_src, "<solution>", "exec"), _ns)
    _fn = _ns.get(%(fn)r)
    if _fn is None and "Solution" in _ns:
        _fn = getattr(_ns["Solution"](), %(fn)r)
    _res = _fn(*_args)
    if isinstance(_res, tuple):
        _res = list(_res)
    _line = (_nonce + " " + _dumps(_res) + "\n").encode()
except BaseException:
    _exit(3)
_write(_fd, _line)
_exit(0)
'''


def _call_program(src: str, fn_name: str) -> str:
    return _HARNESS % {"src": src, "fn": fn_name}


def _reject_constant(name):
    raise ValueError(f"non-finite number {name} in the result")


def _too_deep(x, limit: int = MAX_DEPTH) -> bool:
    stack = [(x, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            if d > limit:
                return True
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def _parse_call_output(out: bytes, nonce: str):
    """(value, None) from the harness's nonce line, else (None, why not). The output is
    already capped at max_output_bytes; NaN/Infinity, more than MAX_DEPTH levels, or
    anything json refuses (ints over Python's digit limit, deep nesting) is refused."""
    for line in out.decode("utf-8", "replace").splitlines():
        if line.startswith(nonce + " "):
            try:
                value = json.loads(line[len(nonce) + 1:], parse_constant=_reject_constant)
            except (ValueError, RecursionError) as e:
                return None, f"result is not plain JSON: {type(e).__name__}: {e}"
            if _too_deep(value):
                return None, f"result nested deeper than {MAX_DEPTH}"
            return value, None
    return None, "no result line (the function did not return)"


def check_tests(tests: dict) -> None:
    if not isinstance(tests, dict) or "inputs" not in tests or "outputs" not in tests:
        raise ValueError(f"code tests must be a dict with 'inputs' and 'outputs', got "
                         f"{type(tests).__name__} with keys {list(tests)[:5] if isinstance(tests, dict) else ''}")
    if len(tests["inputs"]) != len(tests["outputs"]):
        raise ValueError(f"code tests: {len(tests['inputs'])} inputs but "
                         f"{len(tests['outputs'])} outputs")


def _run_status(res) -> str | None:
    """Why a run cannot pass, from the sandbox's view (None: it exited 0)."""
    if res.status != "ok":
        return res.status + (" (out of memory)" if res.oom_kills else "")
    if res.returncode != 0:
        tail = res.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        return f"exit code {res.returncode}" + (f": {tail[0][:100]}" if tail[0] else "")
    return None


def _run_test(sandbox: Sandbox, code: str, tests: dict, i: int) -> str | None:
    """None when test i passes, else the reason it fails."""
    fn = tests.get("fn_name")
    if fn:
        nonce = secrets.token_hex(16)
        args = _parse_json_lines(tests["inputs"][i])
        if not isinstance(args, list):
            args = [args]
        stdin = nonce + "\n" + json.dumps(args) + "\n"
        res = sandbox.run(_call_program(code, fn), stdin)
        if res.status != "ok":
            return _run_status(res)
        value, why = _parse_call_output(res.stdout, nonce)
        if why:
            return why
        return None if call_matches(value, _parse_expected(tests["outputs"][i])) else "wrong answer"
    res = sandbox.run(code, _text(tests["inputs"][i]))
    why = _run_status(res)
    if why:
        return why
    ok = stdout_matches(res.stdout.decode("utf-8", "replace"), _text(tests["outputs"][i]))
    return None if ok else "wrong answer"


def _run_one(sandbox: Sandbox, code: str, tests: dict, i: int) -> str | None:
    """_run_test that never raises: any exception fails the test, with its reason."""
    try:
        return _run_test(sandbox, code, tests, i)
    except SandboxUnavailable:             # the host, not the sample: every test would fail
        raise
    except Exception as e:  # noqa: BLE001 - one sample must never fail the batch
        return f"scoring error: {type(e).__name__}: {e}"[:MAX_REASON_CHARS]


def pass_to_reward(passed: int, total: int, mode: str) -> float:
    p = passed / total if total else 0.0
    if mode == "soft":
        return p
    if mode == "two_p_minus_one":
        return 2.0 * p - 1.0
    return 1.0 if total and passed == total else 0.0


@dataclasses.dataclass
class CodeScore:
    """One sample's score: its reward, and why tests failed (the sample's metadata).
    `format` names the format penalty when the program never ran."""
    reward: float
    passed: int = 0
    total: int = 0
    failures: list = dataclasses.field(default_factory=list)   # [(test index, reason)]
    format: str | None = None


class CodeScorer(Closing):
    """Scores code responses concurrently on `sandbox.slots` threads (one sandbox per test).

    score_batch(responses, tests_list) -> rewards   (blocks; thread-safe)
    score_batch_detailed(...) -> [CodeScore]        (rewards with failure reasons)
    submit_batch(responses, tests_list) -> Future   (returns at once; the RL loop can
                                                      keep sampling and .result() later)
    """

    def __init__(self, cfg: CodeRewardConfig | None = None):
        self.cfg = cfg or CodeRewardConfig()
        self.sandbox = Sandbox(self.cfg.sandbox)
        self._runs = cf.ThreadPoolExecutor(self.cfg.sandbox.slots, thread_name_prefix="sbx")
        # Batches may overlap (a rollout engine submits each chunk's finished samples as
        # they come): their runs share the `slots` sandbox threads above.
        self._batches = cf.ThreadPoolExecutor(self.cfg.sandbox.slots, thread_name_prefix="sbx-batch")
        self._rng, self._rng_lock = random.Random(self.cfg.test_seed), threading.Lock()

    def _format(self, response: str) -> CodeScore | None:
        """The format penalty (think_check orders the tag checks) or no code block, else
        None: the program runs."""
        problem = format_problem(response, self.cfg)
        if problem is not None:
            return CodeScore(problem[0], format=problem[1])
        if extract_code(response) is None:
            return CodeScore(self.cfg.no_code, format="no python block after </think>")
        return None
    def _test_indices(self, n: int) -> list[int]:
        """Which of a problem's n tests to run (test_selection)."""
        m = self.cfg.sandbox.max_tests
        if self.cfg.test_selection == "all" or n <= m:
            return list(range(n))
        if self.cfg.test_selection == "first":
            return list(range(m))
        with self._rng_lock:
            return sorted(self._rng.sample(range(n), m))

    def score_batch(self, responses: list[str], tests_list: list[dict]) -> list[float]:
        return [s.reward for s in self.score_batch_detailed(responses, tests_list)]

    def score_batch_detailed(self, responses: list[str], tests_list: list[dict]) -> list[CodeScore]:
        """Like score_batch, with each sample's passed / total and failure reasons. Raises
        only for a malformed call (lengths, a test set without inputs/outputs) or a host
        that cannot run the sandbox, never for what one sample's program does."""
        if len(responses) != len(tests_list):
            raise ValueError(f"code score_batch: {len(responses)} responses but "
                             f"{len(tests_list)} test sets")
        for k, t in enumerate(tests_list):
            try:
                check_tests(t)
            except ValueError as e:
                raise ValueError(f"batch item {k}: {e}") from None
        rewards = [self._format(r) for r in responses]
        futures, seen = {}, {}
        for k, r in enumerate(responses):
            if rewards[k] is None:
                code = extract_code(r)
                idx = self._test_indices(len(tests_list[k]["inputs"]))
                key = ((code, json.dumps(tests_list[k], sort_keys=True), tuple(idx))
                       if self.cfg.dedupe else k)
                if key in seen:
                    futures[k] = seen[key]
                    continue
                futures[k] = seen[key] = [
                    self._runs.submit(_run_one, self.sandbox, code, tests_list[k], i)
                    for i in idx]
        for k, fs in futures.items():
            reasons = [f.result() for f in fs]
            failures = [(i, why) for i, why in enumerate(reasons) if why is not None]
            passed = len(fs) - len(failures)
            rewards[k] = CodeScore(pass_to_reward(passed, len(fs), self.cfg.mode), passed,
                                   len(fs), failures)
        return rewards

    def submit_batch(self, responses: list[str], tests_list: list[dict]) -> cf.Future:
        return self._batches.submit(self.score_batch, list(responses), list(tests_list))

    def close(self) -> None:
        self._batches.shutdown(wait=True)
        self._runs.shutdown(wait=True)
        self.sandbox.close()


_shared = SharedPerConfig(CodeScorer, CodeRewardConfig)


def code_reward_batch(responses: list[str], tests_list: list[dict],
                      cfg: CodeRewardConfig | None = None) -> list[float]:
    return _shared.get(cfg).score_batch(list(responses), list(tests_list))


def code_reward(response: str, tests: dict, cfg: CodeRewardConfig | None = None) -> float:
    """Soft pass rate (by default) of the response's last python block on `tests`."""
    return code_reward_batch([response], [tests], cfg)[0]
