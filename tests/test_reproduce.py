"""Reproduce-the-paper mode (docs/reproduce.md): every option between the paper's text and
the authors' released run changes exactly what it says, and ``:semantics=official`` sets all
of them at once."""
import dataclasses
import glob
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from klear_jax import config as C
from klear_jax import losses, optim
from klear_jax.rewards import CodeRewardConfig, CodeScorer, MathRewardConfig, SandboxConfig
from klear_jax.rewards.math import format_reward
from klear_jax.rl import batch as rb
from klear_jax.rl import loss as rl_loss
from klear_jax.rl.config import OFFICIAL
from klear_jax.sft.config import OFFICIAL as OFFICIAL_SFT

RL_CONFIGS = ("configs/gppo_math_qwen3_8b.py", "configs/gppo_code_qwen3_8b.py",
              "configs/gppo_tiny.py")


def _flat(c) -> dict:
    out = {}
    for k, v in c.items():
        if hasattr(v, "items"):
            out.update({f"{k}.{kk}": vv for kk, vv in _flat(v).items()})
        else:
            out[k] = v
    return out


# ------------------------------------------------------------------------ the one switch
@pytest.mark.parametrize("spec", RL_CONFIGS + ("configs/sft_qwen3_8b.py",))
def test_semantics_official_changes_exactly_the_listed_keys(spec):
    official = OFFICIAL_SFT if "sft" in spec else OFFICIAL
    paper, theirs = _flat(C.load_config(spec)), _flat(C.load_config(spec + ":semantics=official"))
    changed = {k for k in paper if paper[k] != theirs[k]}
    assert changed == set(official), changed ^ set(official)
    assert all(theirs[k] == v for k, v in official.items())
    with pytest.raises(C.ConfigError, match="semantics"):
        C.load_config(spec + ":semantics=verl")


# ------------------------------------------------------------------------ normalisation
class _Bigram:
    """The policy, small: log p(target | token) = log_softmax(theta[token])[target]; theta
    [V, V] are the parameters the gradients are taken against."""

    def __init__(self, theta):
        self.theta = theta

    def token_logprobs(self, input_ids, targets, positions=None, segment_ids=None,
                       temperature=1.0):
        logits = self.theta[input_ids] / temperature
        return jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0], None


def _batch(resp_lens, prompt_len=4, T=40, seed=0, pad_rows=0):
    """Rows prompt ++ response (random tokens), right-padded; the last ``pad_rows`` empty;
    old_logp = the initial policy's log-probs + noise (ratios leave the clip range)."""
    rng = np.random.default_rng(seed)
    R = len(resp_lens) + pad_rows
    ids = np.zeros((R, T), np.int32)
    mask = np.zeros((R, T), np.float32)
    seg = np.zeros((R, T), np.int32)
    for r, n in enumerate(resp_lens):
        L = prompt_len + n
        ids[r, :L] = rng.integers(1, 64, L)
        mask[r, prompt_len - 1:L - 1] = 1.0
        seg[r, :L] = 1
    tgt = np.zeros_like(ids)
    tgt[:, :-1] = ids[:, 1:]
    adv = rng.normal(size=R).astype(np.float32) * (seg.any(1))
    pos = ((adv > 0.3) & seg.any(1)).astype(np.float32)
    mb = {"input_ids": ids, "targets": tgt * seg, "loss_mask": mask, "segment_ids": seg,
          "advantages": adv, "positive": pos}
    logp, _ = _Bigram(_theta()).token_logprobs(mb["input_ids"], mb["targets"])
    mb["old_logp"] = np.where(mask > 0, np.asarray(logp) + rng.normal(0, 0.4, logp.shape), 0.0
                              ).astype(np.float32)
    return mb


def _theta(seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(0, 1.0, (64, 64)), jnp.float32)


def _authors_update(mb, rows_per_device, max_tokens, alpha=0.1):
    """An independent emulation of the authors' dp_actor.update_policy on one mini-batch:
    each device's rows_per_device rows (real rows only) are split into ceil(tokens /
    max_tokens) micro-batches (here always all-together or one row each); each micro-batch's
    loss is gppo token-mean + alpha x positive NLL token-mean (0 without a positive row),
    times rows / rows_per_device; gradients average over devices."""
    seq = (mb["segment_ids"] > 0).sum(1)
    R = seq.shape[0]
    plan = []
    for d in range(0, R, rows_per_device):
        rows = [r for r in range(d, d + rows_per_device) if seq[r] > 0]
        if not rows:
            continue
        n = -(-int(seq[rows].sum()) // max_tokens)
        assert n in (1, len(rows)), "the emulation handles all-together or singletons"
        plan += [rows] if n == 1 else [[r] for r in rows]
    devices = R // rows_per_device

    def loss(theta):
        total = 0.0
        for part in plan:
            sub = {k: jnp.asarray(v[part]) for k, v in mb.items()}
            logp, _ = _Bigram(theta).token_logprobs(sub["input_ids"], sub["targets"])
            l, _ = losses.policy_loss(logp, sub["old_logp"], sub["advantages"], sub["loss_mask"],
                                      sft_alpha=alpha, positive=sub["positive"], kind="gppo",
                                      dual_clip=10.0)
            total = total + l * len(part) / rows_per_device
        return total / devices
    return loss


def _our_update(mb, normalize, agg="token-mean", partial="scaled", alpha=0.1):
    """The project's RL objective (rl.loss.make_rl_loss) on the whole mini-batch."""
    lc = rl_loss.RLLossConfig(losses.PolicyLoss(kind="gppo", dual_clip=10.0, agg=agg), alpha,
                              1.0, normalize, partial)
    L = rl_loss.make_rl_loss(lc)
    batch = {k: jnp.asarray(v) for k, v in mb.items()}

    def loss(theta):
        sums, _, _ = L.loss_fn(_Bigram(theta), batch)
        den = L.denom_fn(batch)
        return sum(L.loss_weights[k] * sums[k] / den[k] for k in sums)
    return loss


def _cos(a, b):
    a, b = np.ravel(a), np.ravel(b)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("rows_per_device,lens", [
    (2, [3, 30, 5, 6, 25, 28, 2, 12]),   # math: short pairs share a micro-batch, long ones split
    (4, [3, 4, 5, 6, 5, 4, 2, 6]),       # code: 4 rows a device, one micro-batch each
    (2, [16, 26, 14, 21, 27, 18, 26]),   # every row alone; the last device holds one real row
])
def test_microbatch_normalisation_is_the_authors_update(rows_per_device, lens):
    max_tokens = 34  # verl: max_prompt_length + max_response_length (the longest row)
    mb = _batch(lens, pad_rows=8 - len(lens))
    mb["pg_scale"], mb["sft_scale"] = rb.verl_microbatch_scales(mb, rows_per_device, max_tokens)
    theta = _theta()
    grad = lambda f: jax.jit(jax.value_and_grad(f))(theta)  # noqa: E731
    v_t, g_t = grad(_authors_update(mb, rows_per_device, max_tokens))
    v_o, g_o = grad(_our_update(mb, "microbatch"))
    np.testing.assert_allclose(float(v_o), float(v_t), rtol=1e-5)
    assert _cos(g_o, g_t) > 1 - 1e-6
    # the paper's global token-mean is a different update on the same batch
    cos_tm = _cos(grad(_our_update(mb, "minibatch"))[1], g_t)
    cos_sm = _cos(grad(_our_update(mb, "minibatch", agg="seq-mean-token-mean"))[1], g_t)
    print(f"cosine with the authors' update: token-mean {cos_tm:.4f}, "
          f"seq-mean-token-mean {cos_sm:.4f}")
    assert cos_tm < 0.999
    if len(lens) == 7:  # one row per micro-batch: the policy term is seq-mean-token-mean
        assert cos_sm > cos_tm


def test_partial_minibatch_scaling_and_denominators():
    """full: a short mini-batch is a full-size step; scaled / drop: x real rows / B."""
    mb = {k: jnp.asarray(v) for k, v in _batch([3, 5, 7], pad_rows=5).items()}
    tokens, pos_tokens = float(mb["loss_mask"].sum()), float(
        (mb["loss_mask"] * mb["positive"][:, None]).sum())
    for normalize in ("minibatch", "microbatch"):
        for partial in rl_loss.PARTIAL_MINIBATCH:
            lc = rl_loss.RLLossConfig(normalize=normalize, partial_minibatch=partial)
            d = rl_loss.make_rl_loss(lc).denom_fn(mb)
            f = 1.0 if partial == "full" else 8 / 3
            want = ((tokens * f, pos_tokens * f) if normalize == "minibatch"
                    else (8.0 if partial != "full" else 3.0,) * 2)
            np.testing.assert_allclose([float(d["pg"]), float(d["sft"])], want, rtol=1e-6)
    empty = {k: jnp.zeros_like(v) for k, v in mb.items()}
    for normalize in ("minibatch", "microbatch"):
        d = rl_loss.make_rl_loss(rl_loss.RLLossConfig(normalize=normalize,
                                                      partial_minibatch="scaled")).denom_fn(empty)
        assert float(d["pg"]) == 0.0  # nothing to train on: the train step skips it


def test_verl_scales_split_devices_into_micro_batches():
    mb = _batch([3, 30, 5, 6], prompt_len=4)  # sequence lengths 7, 34, 9, 10
    pg, sft = rb.verl_microbatch_scales(mb, rows_per_device=2, max_tokens=34)
    # device 0: 7 + 34 > 34 -> two micro-batches of one row; device 1: 9 + 10 <= 34 -> one
    np.testing.assert_allclose(pg, [1 / 3, 1 / 30, 2 / 11, 2 / 11], rtol=1e-6)
    pos = mb["positive"] > 0
    assert np.all((sft > 0) == pos)


# ------------------------------------------------------------------------ group filter
def test_group_filter_on_constructed_groups():
    rewards = np.array([
        [1.0, -1.0, -1.0, -1.0],     # math, mixed: both keep
        [-1.0, -0.5, -1.0, -2.0],    # math, wrong answers differing by format penalty
        [0.5, 0.25, 0.0, 0.75],      # code, partial passes but no full pass
        [1.0, 0.5, 0.0, 0.0],        # code, one full pass
        [1.0, 1.0, 1.0, 1.0],        # all correct: nobody keeps it
        [-1.0, -1.0, -1.0, -1.0],    # all wrong
        [-0.5, -1.0, 0.0, 1.0],      # code 2p - 1: one full pass
    ], np.float32)
    correct = rewards >= 1.0
    kept, signal = rb.select_groups(rewards, batch_prompts=10)
    assert kept.tolist() == [0, 1, 2, 3, 6] and signal.tolist() == [1, 1, 1, 1, 0, 0, 1]
    kept, signal = rb.select_groups(rewards, batch_prompts=10, correct=correct)
    assert kept.tolist() == [0, 3, 6] and signal.tolist() == [1, 0, 0, 1, 0, 0, 1]
    assert rb.select_groups(rewards, 2, correct=correct)[0].tolist() == [0, 3]
    assert rb.select_groups(rewards, 10, False, correct=correct)[0].tolist() == list(range(7))


# ------------------------------------------------------------------------ rewards
def test_think_check_orders_the_tag_penalties():
    neither, no_close, no_open = "\\boxed{1}", "<think> \\boxed{1}", "x</think> \\boxed{1}"
    want = {"open_first": (-2.0, -0.5, -2.0), "close_first": (-0.5, -0.5, -2.0),
            "none": (None, None, None)}
    for order, w in want.items():
        cfg = MathRewardConfig(think_check=order)
        assert tuple(format_reward(r, cfg) for r in (neither, no_close, no_open)) == w
    with pytest.raises(ValueError, match="think_check"):
        MathRewardConfig(think_check="both")
    with pytest.raises(ValueError, match="think_check"):
        CodeRewardConfig(think_check="both")


def _resp(code, think=True):
    return ("<think>plan</think>\n" if think else "") + f"```python\n{code}\n```\n"


def test_code_reward_orderings_soft_vs_two_p_minus_one():
    """The paper's p puts "every test fails" (0) above "no </think>" (-0.5); the authors'
    2p - 1 puts it at -1, with "no code block", below the format penalty."""
    tests = {"inputs": ["1\n", "2\n"], "outputs": ["1\n", "2\n"]}
    responses = {"all_pass": _resp("print(input())"), "half": _resp("print(1)"),
                 "all_fail": _resp("print(0)"), "no_close": "<think>x ```python\nprint(1)\n```",
                 "no_code": "<think>x</think> none", "no_open": _resp("print(1)", think=False)}
    got = {}
    for mode in ("soft", "two_p_minus_one"):
        sbx = SandboxConfig(timeout_s=5.0, num_slots=2, allow_unsandboxed=True)
        with CodeScorer(CodeRewardConfig(mode=mode, sandbox=sbx)) as s:
            got[mode] = dict(zip(responses, s.score_batch(list(responses.values()),
                                                          [tests] * len(responses))))
    assert got["soft"] == {"all_pass": 1.0, "half": 0.5, "all_fail": 0.0, "no_close": -0.5,
                           "no_code": -1.0, "no_open": -2.0}
    assert got["two_p_minus_one"] == {"all_pass": 1.0, "half": 0.0, "all_fail": -1.0,
                                      "no_close": -0.5, "no_code": -1.0, "no_open": -2.0}
    assert got["soft"]["all_fail"] > got["soft"]["no_close"]
    assert got["two_p_minus_one"]["all_fail"] < got["two_p_minus_one"]["no_close"]


def _ran_tests(monkeypatch, cfg, n_tests, n_responses=4):
    """Indices of the tests each response was run on (sandbox runs replaced by a stub)."""
    import klear_jax.rewards.code as code_mod
    runs = []
    monkeypatch.setattr(code_mod, "_run_one",  # None: the test passed
                        lambda sbx, code, tests, i: runs.append((code, i)))
    tests = {"inputs": [f"{i}\n" for i in range(n_tests)], "outputs": ["0\n"] * n_tests}
    resps = [_resp(f"print({k})") for k in range(n_responses)]
    with CodeScorer(cfg) as s:
        assert s.score_batch(resps, [tests] * n_responses) == [1.0] * n_responses
    return [sorted(i for c, i in runs if c == f"print({k})\n") for k in range(n_responses)]


def test_test_selection_first_random_all(monkeypatch):
    sbx = SandboxConfig(max_tests=16, num_slots=2, allow_unsandboxed=True)
    first = _ran_tests(monkeypatch, CodeRewardConfig(sandbox=sbx), 40)
    assert first == [list(range(16))] * 4
    rand = _ran_tests(monkeypatch, CodeRewardConfig(sandbox=sbx, test_selection="random"), 40)
    assert all(len(set(r)) == 16 and max(r) < 40 for r in rand)
    assert len({tuple(r) for r in rand}) > 1 and max(max(r) for r in rand) >= 16
    again = _ran_tests(monkeypatch, CodeRewardConfig(sandbox=sbx, test_selection="random"), 40)
    assert again == rand  # seeded by test_seed
    every = _ran_tests(monkeypatch, CodeRewardConfig(sandbox=sbx, test_selection="all"), 40)
    assert every == [list(range(40))] * 4
    assert _ran_tests(monkeypatch, CodeRewardConfig(sandbox=sbx, test_selection="random"),
                      5) == [list(range(5))] * 4


# ------------------------------------------------------------------------ eval protocol
def test_eval_config_is_the_official_protocol(monkeypatch):
    c = C.load_config("configs/eval_qwen3_8b.py")
    assert {b: (c.benchmarks[b].kind, c.benchmarks[b].num_samples) for b in c.benchmarks} == {
        "aime24": ("math", 64), "aime25": ("math", 64), "hmmt25": ("math", 64),
        "lcb_v5": ("code", 8), "lcb_v6": ("code", 8)}
    s = c.settings.paper
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (0.6, 0.95, 20, 1.05)
    code, maths = C.code_reward_config(c), C.math_reward_config(c)
    assert code.test_selection == "all" and code.think_check == maths.think_check == "none"
    # every LiveCodeBench test runs: 40 here, not the 16 the RL reward samples
    sbx = SandboxConfig(num_slots=2, allow_unsandboxed=True)
    assert _ran_tests(monkeypatch, dataclasses.replace(code, sandbox=sbx), 40, 1) == [
        list(range(40))]


def test_eval_yarn_only_beyond_the_native_window():
    from klear_jax.eval import config as ec
    long = ec.model_overrides(C.load_config("configs/eval_qwen3_8b.py"))
    assert long["rope_scaling"] == {"factor": 2.5, "original_max_position_embeddings": 32768}
    assert long["max_position_embeddings"] == 81920 >= 4096 + 65536
    c32 = C.load_config("configs/eval_qwen3_8b.py:max_new=32768")
    assert c32.settings.paper.max_new_tokens == 32768 and c32.model.rope_scaling_factor == 0
    assert "rope_scaling" not in ec.model_overrides(c32)
    assert 4096 + 32768 <= C.MODEL_PRESETS["qwen3_8b"]["max_position_embeddings"]


# ------------------------------------------------------------------------ optimizer
def test_weight_decay_mask_matrices_vs_all():
    params = {"layer": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones((2,))},
              "final_norm": {"scale": jnp.ones((2,))}}
    zeros = jax.tree.map(jnp.zeros_like, params)
    base = dict(lr=1.0, end_lr=1.0, schedule="constant", warmup_steps=0, decay_steps=0,
                b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1, clip_norm=0.0)
    for mask, decayed in (("matrices", {"kernel"}), ("all", {"kernel", "bias", "scale"})):
        tx, _ = optim.make_optimizer(dict(base, weight_decay_mask=mask), 1)
        upd, _ = tx.update(zeros, tx.init(params), params)
        moved = {p[-1].key for p, u in jax.tree_util.tree_leaves_with_path(upd)
                 if float(jnp.abs(u).max()) > 0}
        assert moved == decayed, (mask, moved)


# ------------------------------------------------------------------------ curation
def test_dedup_keeps_up_to_max_per_prompt():
    from klear_jax.curate import steps as S
    from klear_jax.data.records import RawRecord
    recs = [RawRecord("f", i, {"prompt": p, "response": f"r{i}"})
            for i, p in enumerate(["a", "a", "a", "b", "A!", "b"])]
    for cap, kept in ((1, [0, 3]), (2, [0, 1, 3, 5]), (16, list(range(6))), (0, list(range(6)))):
        step = S.dedup_step("dedup_prompt", S.prompt_text, max_copies=cap)
        assert [r.line for r in step(iter(recs))] == kept, cap


def test_curate_paper_recipes():
    from klear_jax.curate.config import validate_curate_config
    for kind in ("sft", "rl_math", "rl_code"):
        c = C.load_config(f"configs/curate_paper.py:kind={kind}")
        c.unlock()
        c.output.tokenizer = "tok"
        validate_curate_config(c)
        if kind == "sft":
            assert c.dedup.max_per_prompt == 16 and not c.label.enabled
            assert c.retain.keep_incorrect_easy and c.retain.keep_incorrect_hard
            assert c.output.max_length == 32768
        else:  # kept when more than half of 16 reference samples pass
            assert c.rl_filter.min_pass_rate * 16 == 9 and c.rl_filter.max_pass_rate == 1.0
            assert c.rl_filter.min_tests == (16 if kind == "rl_code" else 0)
    ref = C.load_config("configs/curate_paper.py:kind=rl_code,ref=/ckpt")
    assert ref.pass_rate.source == "model" and ref.pass_rate.model.num_samples == 16


# ------------------------------------------------------------------------ the doc table
def _config_for(item: str):
    stage = item.split(":", 1)[0].strip()
    return {"SFT": "configs/sft_qwen3_8b.py", "curation": "configs/curate_paper.py:kind=sft",
            "RL data": "configs/curate_paper.py:kind=rl_code",
            "RL": "configs/gppo_math_qwen3_8b.py",
            "RL code": "configs/gppo_code_qwen3_8b.py", "eval": "configs/eval_qwen3_8b.py",
            "eval 32K": "configs/eval_qwen3_8b.py:max_new=32768"}[stage]


def _assignments(cell: str) -> dict:
    out = {}
    for key, raw in re.findall(r"`([a-z_][\w.]*)=([^`]+)`", cell):
        try:
            out[key] = float(raw) if re.fullmatch(r"[-+\d.e]+", raw) else {
                "True": True, "False": False}.get(raw, raw)
        except ValueError:
            out[key] = raw
    return out


def test_reproduce_doc_table_matches_the_configs():
    """Every row of docs/reproduce.md's table: the `key=value` pairs of "our default" hold in
    the paper-setting config; those of a "switch" marked *official* hold under
    ``:semantics=official``, other switches name keys of the config; the row names the
    tests that back it."""
    text = open("docs/reproduce.md").read()
    rows = [r for r in text.splitlines() if r.startswith("| ") and not r.startswith("| item")
            and not set(r) <= set("|- ")]
    assert len(rows) >= 40, len(rows)
    tests = "".join(open(f).read() for f in glob.glob("tests/test_*.py"))
    checked = official_rows = 0
    for row in rows:
        item, paper, authors, ours, switch, backed = [c.strip() for c in row.strip("|").split("|")]
        spec = _config_for(item)
        assert re.search(r"`(test_\w+)`", backed), f"row {item!r} names no test"
        for name in re.findall(r"`(test_\w+)`", backed):
            assert f"def {name}" in tests, f"row {item!r}: no test {name}"
        flat = _flat(C.load_config(spec))
        for key, want in _assignments(ours).items():
            assert key in flat, f"row {item!r}: {key} is not a key of {spec}"
            got = flat[key]
            assert (math.isclose(got, want) if isinstance(want, float) and not isinstance(got, str)
                    else got == want), f"row {item!r}: {key} = {got!r}, table says {want!r}"
            checked += 1
        official = "*official*" in switch
        alt = _flat(C.load_config(spec + ":semantics=official")) if official else flat
        for key, want in _assignments(switch).items():
            assert key in alt, f"row {item!r}: switch key {key} is not in {spec}"
            if official:
                assert alt[key] == want, f"row {item!r}: official {key} = {alt[key]!r}"
            checked += 1
        official_rows += official
    assert checked >= 40
    # every official override is a row of the table
    assert official_rows == len(OFFICIAL) + len(OFFICIAL_SFT)
