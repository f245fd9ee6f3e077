"""Synthetic tasks for the CPU demo: multi-step arithmetic (math) and tiny Python functions
(code), an imperfect teacher that writes worked solutions for SFT, and the JSONL files the
data path (``klear_jax.data.prepare``) and the eval command read.

Math problem:  "Compute 7 + 5 - 3 * 2."  evaluated left to right, one step per line::

    <think>
    7+5=12
    12-3=9
    9*2=18
    </think>
    \\boxed{18}

Code problem:  "Write f(x) that returns x times 3 plus 2. Example: f(1) == 5." graded by
hidden function-call tests ``{"fn_name": "f", "inputs": [[x], ...], "outputs": [y, ...]}``::

    <think>
    x*3+2
    </think>
    ```python
    def f(x):
        return x*3+2
    ```

The teacher is wrong on a fraction of its traces (an off-by-one step, a swapped operator, a
wrong constant), like distillation data from a stronger but fallible model, so SFT learns a
distribution with mass on wrong answers, which RL with verifiable rewards can then sharpen.
"""

from __future__ import annotations

import json
import os
import random
from typing import Iterable

OPS = ("+", "-", "*")
# name -> (expression template, words template); A and B are small constants.
CODE_FAMILIES = {
    "affine": ("x*{A}+{B}", "x times {A} plus {B}"),
    "shift_mul": ("(x+{A})*{B}", "x plus {A}, times {B}"),
    "sub_mul": ("(x-{A})*{B}", "x minus {A}, times {B}"),
    "max": ("max(x,{A})", "the larger of x and {A}"),
    "min": ("min(x,{A})", "the smaller of x and {A}"),
    "mod": ("x%{A}+{B}", "x modulo {A} plus {B}"),
}
_SWAP = {"+": "-", "-": "+", "*": "+"}


# ------------------------------------------------------------------------------ math
def math_problem(rng: random.Random, num_ops: tuple[int, int] = (2, 3), max_operand: int = 9):
    """-> dict(problem, answer, operands, ops). Left-to-right evaluation, no precedence."""
    k = rng.randint(*num_ops)
    xs = [rng.randint(1, max_operand) for _ in range(k + 1)]
    ops = [rng.choice(OPS) for _ in range(k)]
    # keep intermediate values small (at most 2 digits, non-negative) by re-drawing '*'
    v = xs[0]
    for i, op in enumerate(ops):
        if op == "*" and v * xs[i + 1] > 99:
            ops[i] = op = "+"
        if op == "-" and v - xs[i + 1] < 0:
            ops[i] = op = "+"
        v = _apply(v, op, xs[i + 1])
    expr = " ".join(str(xs[0]) if i == 0 else f"{ops[i - 1]} {xs[i]}" for i in range(k + 1))
    return {"problem": f"Compute {expr}.", "answer": str(v), "operands": xs, "ops": ops}


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def math_solution(p: dict, rng: random.Random, error_rate: float) -> tuple[str, bool]:
    """The teacher's worked solution -> (text, correct). With probability ``error_rate`` one
    step goes wrong (off by one, or the wrong operator) and the error propagates."""
    xs, ops = p["operands"], p["ops"]
    bad = rng.randrange(len(ops)) if rng.random() < error_rate else -1
    v, lines = xs[0], []
    for i, op in enumerate(ops):
        r = _apply(v, op, xs[i + 1])
        if i == bad:
            r = _apply(v, _SWAP[op], xs[i + 1]) if rng.random() < 0.5 else r + rng.choice((-1, 1))
        lines.append(f"{v}{op}{xs[i + 1]}={r}")
        v = r
    text = "<think>\n" + "\n".join(lines) + "\n</think>\n\\boxed{" + str(v) + "}"
    return text, str(v) == p["answer"]


# ------------------------------------------------------------------------------ code
def code_problem(rng: random.Random, num_tests: int = 4):
    """-> dict(problem, tests, family, A, B, expr). Tests are hidden (not in the prompt)."""
    fam = rng.choice(sorted(CODE_FAMILIES))
    A, B = rng.randint(2, 9), rng.randint(1, 9)
    expr_t, words_t = CODE_FAMILIES[fam]
    expr, words = expr_t.format(A=A, B=B), words_t.format(A=A, B=B)
    fn = eval("lambda x: " + expr)  # our own generated expression, not model output
    ex = rng.randint(0, 9)
    xs = rng.sample(range(-5, 20), num_tests)
    problem = f"Write f(x) that returns {words}. Example: f({ex}) == {fn(ex)}."
    tests = {"fn_name": "f", "inputs": [[x] for x in xs], "outputs": [fn(x) for x in xs]}
    return {"problem": problem, "tests": tests, "family": fam, "A": A, "B": B, "expr": expr}


def code_solution(p: dict, rng: random.Random, error_rate: float) -> tuple[str, bool]:
    """The teacher's solution -> (text, correct). Wrong ones swap min/max or an operator, or
    are off by one in a constant: they still pass some hidden tests (soft reward)."""
    expr, ok = p["expr"], True
    if rng.random() < error_rate:
        ok = False
        r = rng.random()
        if "max" in expr or "min" in expr:
            expr = expr.replace("max", "MIN").replace("min", "max").replace("MIN", "min") \
                if r < 0.5 else expr.replace(str(p["A"]), str(p["A"] + 1))
        elif r < 0.5:
            i = max(expr.rfind("+"), expr.rfind("-"))
            expr = expr[:i] + _SWAP[expr[i]] + expr[i + 1:] if i > 0 else expr + "+1"
        else:
            expr = expr.replace(str(p["A"]), str(p["A"] + 1), 1)
    text = f"<think>\n{expr}\n</think>\n```python\ndef f(x):\n    return {expr}\n```"
    return text, ok


# ------------------------------------------------------------------------------ files
def write_jsonl(path: str, rows: Iterable[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def build_task_files(out_dir: str, seed: int, n_sft: int, n_rl: int, n_eval: int,
                     math_error: float, code_error: float, code_frac: float = 0.4,
                     num_ops: tuple[int, int] = (2, 3), num_tests: int = 4,
                     max_operand: int = 9) -> dict:
    """Writes the demo's JSONL files into ``out_dir``; returns their paths and teacher stats.

    sft.jsonl          {"messages": [user, assistant], "source"}: teacher traces, mixed tasks
    rl_math.jsonl      {"problem", "answer", "source"}       (RL prompts)
    rl_code.jsonl      {"problem", "tests", "source"}
    heldout_math.jsonl {"problem", "answer"}   eval input format; never trained on
    heldout_code.jsonl {"problem", "tests"}
    Held-out problems are drawn first; no training record repeats one (math: same text;
    code: same function). Training sets may repeat problems among themselves.
    """
    rng = random.Random(seed)
    seen: set[str] = set()   # held-out math problem texts and code expressions

    def draw(kind: str, n: int, held_out: bool = False) -> list[dict]:
        """Held-out problems are distinct, and no training problem equals one: math by text,
        code by function (its expression). Training sets may repeat a problem."""
        out, tries = [], 0
        while len(out) < n:
            tries += 1
            if tries > 50 * n + 1000:
                raise RuntimeError(f"demo tasks: cannot draw {n} {kind} problems")
            p = (math_problem(rng, num_ops, max_operand) if kind == "math"
                 else code_problem(rng, num_tests))
            key = p["problem"] if kind == "math" else p["expr"]
            if key in seen:
                continue
            if held_out:
                seen.add(key)
            out.append(p)
        return out

    held_math, held_code = draw("math", n_eval, True), draw("code", n_eval, True)
    n_sft_code = int(round(n_sft * code_frac))
    sft_math, sft_code = draw("math", n_sft - n_sft_code), draw("code", n_sft_code)
    rl_math, rl_code = draw("math", n_rl), draw("code", n_rl)

    stats = {"math_correct": 0, "math_total": 0, "code_correct": 0, "code_total": 0}
    sft_rows = []
    for kind, probs, solve, err in (("math", sft_math, math_solution, math_error),
                                    ("code", sft_code, code_solution, code_error)):
        for p in probs:
            text, ok = solve(p, rng, err)
            stats[f"{kind}_correct"] += int(ok)
            stats[f"{kind}_total"] += 1
            sft_rows.append({"messages": [{"role": "user", "content": p["problem"]},
                                          {"role": "assistant", "content": text}],
                             "source": f"teacher_{kind}"})
    rng.shuffle(sft_rows)
    paths = {k: os.path.join(out_dir, f"{k}.jsonl") for k in
             ("sft", "rl_math", "rl_code", "heldout_math", "heldout_code")}
    write_jsonl(paths["sft"], sft_rows)
    write_jsonl(paths["rl_math"], ({"problem": p["problem"], "answer": p["answer"],
                                    "source": "math"} for p in rl_math))
    write_jsonl(paths["rl_code"], ({"problem": p["problem"], "tests": p["tests"],
                                    "source": "code"} for p in rl_code))
    write_jsonl(paths["heldout_math"], ({"problem": p["problem"], "answer": p["answer"]}
                                        for p in held_math))
    write_jsonl(paths["heldout_code"], ({"problem": p["problem"], "tests": p["tests"]}
                                        for p in held_code))
    teacher = {k: stats[f"{k}_correct"] / max(stats[f"{k}_total"], 1) for k in ("math", "code")}
    return {"paths": paths, "teacher_accuracy": teacher, "counts": {
        "sft": len(sft_rows), "rl_math": len(rl_math), "rl_code": len(rl_code),
        "heldout_math": len(held_math), "heldout_code": len(held_code)}}


def tokenizer_corpus(paths: dict) -> Iterable[str]:
    """Texts to train the demo's tokenizer on: every SFT message and RL prompt."""
    with open(paths["sft"]) as f:
        for line in f:
            for m in json.loads(line)["messages"]:
                yield m["content"]
    for k in ("rl_math", "rl_code"):
        with open(paths[k]) as f:
            for line in f:
                yield json.loads(line)["problem"]
