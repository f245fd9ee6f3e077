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

Reward (CodeRewardConfig.mode), p = fraction of the first `max_tests` tests passed:
    "soft" (default, the paper's) -> p;  "two_p_minus_one" (their code) -> 2p - 1;
    "all_or_nothing" -> 1.0 if p == 1 else 0.0.
Format (same values as math, from the Klear code): no `<think>` when required -> -2.0,
no `</think>` -> -0.5, no python block after `</think>` -> no_code (-1.0).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import decimal
import json
import math
import re
import secrets

from klear_jax.rewards.pool import Closing, SharedPerConfig
from klear_jax.rewards.sandbox import Sandbox, SandboxConfig

_BLOCK = re.compile(r"```(?:python3?|py)[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)
MODES = ("soft", "two_p_minus_one", "all_or_nothing")


@dataclasses.dataclass(frozen=True)
class CodeRewardConfig:
    mode: str = "soft"
    no_code: float = -1.0
    missing_close_think: float = -0.5
    missing_open_think: float = -2.0
    require_open_think: bool = True
    # Identical programs graded on identical tests within one batch run once and share the
    # result (sampled groups repeat programs often: the demo's held-out code samples at T=1.0
    # hold ~1/3 unique programs). Off by default: a program that draws random numbers then
    # gets one draw for all its copies.
    dedupe: bool = False
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"CodeRewardConfig.mode must be one of {MODES}, got {self.mode!r}")


def extract_code(response: str) -> str | None:
    """The last ```python block after the last `</think>` (None if there is none)."""
    blocks = _BLOCK.findall(response.rsplit("</think>", 1)[-1])
    return blocks[-1] if blocks else None


def _text(x) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def _lines(s: str) -> list[str]:
    return [ln.rstrip() for ln in s.strip().splitlines()]


def _num_tokens(line: str):
    try:
        return [decimal.Decimal(t) for t in line.split()]
    except decimal.InvalidOperation:
        return None


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
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or (math.isfinite(a) and math.isfinite(b) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9))
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


def _parse_call_output(out: bytes, nonce: str):
    """(True, value) from the harness's nonce line, else (False, None)."""
    for line in out.decode("utf-8", "replace").splitlines():
        if line.startswith(nonce + " "):
            try:
                return True, json.loads(line[len(nonce) + 1:])
            except ValueError:
                return False, None
    return False, None


def check_tests(tests: dict) -> None:
    if not isinstance(tests, dict) or "inputs" not in tests or "outputs" not in tests:
        raise ValueError(f"code tests must be a dict with 'inputs' and 'outputs', got "
                         f"{type(tests).__name__} with keys {list(tests)[:5] if isinstance(tests, dict) else ''}")
    if len(tests["inputs"]) != len(tests["outputs"]):
        raise ValueError(f"code tests: {len(tests['inputs'])} inputs but "
                         f"{len(tests['outputs'])} outputs")


def _run_one(sandbox: Sandbox, code: str, tests: dict, i: int) -> bool:
    fn = tests.get("fn_name")
    if fn:
        nonce = secrets.token_hex(16)
        args = _parse_json_lines(tests["inputs"][i])
        if not isinstance(args, list):
            args = [args]
        stdin = nonce + "\n" + json.dumps(args) + "\n"
        res = sandbox.run(_call_program(code, fn), stdin)
        if res.status != "ok":
            return False
        ok, value = _parse_call_output(res.stdout, nonce)
        return ok and call_matches(value, _parse_expected(tests["outputs"][i]))
    res = sandbox.run(code, _text(tests["inputs"][i]))
    if res.status != "ok" or res.returncode != 0:
        return False
    return stdout_matches(res.stdout.decode("utf-8", "replace"), _text(tests["outputs"][i]))


def pass_to_reward(passed: int, total: int, mode: str) -> float:
    p = passed / total if total else 0.0
    if mode == "soft":
        return p
    if mode == "two_p_minus_one":
        return 2.0 * p - 1.0
    return 1.0 if total and passed == total else 0.0


class CodeScorer(Closing):
    """Scores code responses concurrently on `sandbox.slots` threads (one sandbox per test).

    score_batch(responses, tests_list) -> rewards   (blocks; thread-safe)
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

    def _format(self, response: str) -> float | None:
        cfg = self.cfg
        if cfg.require_open_think and "<think>" not in response:
            return cfg.missing_open_think
        if "</think>" not in response:
            return cfg.missing_close_think
        if extract_code(response) is None:
            return cfg.no_code
        return None

    def score_batch(self, responses: list[str], tests_list: list[dict]) -> list[float]:
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
        n_max = self.cfg.sandbox.max_tests
        for k, r in enumerate(responses):
            if rewards[k] is None:
                code = extract_code(r)
                key = (code, json.dumps(tests_list[k], sort_keys=True)) if self.cfg.dedupe else k
                if key in seen:
                    futures[k] = seen[key]
                    continue
                n = min(n_max, len(tests_list[k]["inputs"]))
                futures[k] = seen[key] = [
                    self._runs.submit(_run_one, self.sandbox, code, tests_list[k], i)
                    for i in range(n)]
        for k, fs in futures.items():
            passed = sum(bool(f.result()) for f in fs)
            rewards[k] = pass_to_reward(passed, len(fs), self.cfg.mode)
        return rewards

    def submit_batch(self, responses: list[str], tests_list: list[dict]) -> cf.Future:
        return self._batches.submit(self.score_batch, list(responses), list(tests_list))

    def close(self) -> None:
        self._batches.shutdown(wait=True)
        self._runs.shutdown(wait=True)


_shared = SharedPerConfig(CodeScorer, CodeRewardConfig)


def code_reward_batch(responses: list[str], tests_list: list[dict],
                      cfg: CodeRewardConfig | None = None) -> list[float]:
    return _shared.get(cfg).score_batch(list(responses), list(tests_list))


def code_reward(response: str, tests: dict, cfg: CodeRewardConfig | None = None) -> float:
    """Soft pass rate (by default) of the response's last python block on `tests`."""
    return code_reward_batch([response], [tests], cfg)[0]
