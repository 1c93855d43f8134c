"""loss.py: hand-computed branches, and the vectorized loss against a plain per-token loop."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loss import group_advantages, grpo_loss


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def one_token(logp: float, old: float, beh: float, adv: float, **kw):
    """Loss, d loss / d logprob and metrics for a single loss token."""
    lp = t(logp).requires_grad_()
    loss, m = grpo_loss(lp, t(old), t(beh), t(adv), t(1), torch.tensor([0]), **kw)
    loss.backward()
    return loss.item(), lp.grad.item(), m


def reference(
    lp,
    old,
    beh,
    adv,
    mask,
    seq,
    ref=None,
    beta=0.0,
    norm="token",
    denom=None,
    eps_low=0.2,
    eps_high=0.28,
    cap=2.0,
):
    """Plain loop over tokens, written from the formula, no vectorization."""
    per_seq: dict[int, list] = {}
    total = 0.0
    for i in range(len(lp)):
        if not mask[i]:
            continue
        r = torch.exp(lp[i] - old[i])
        w = min(math.exp(old[i] - beh[i]), cap)
        r_clip = torch.clamp(r, 1 - eps_low, 1 + eps_high)
        ell = -w * torch.minimum(r * adv[i], r_clip * adv[i])
        if beta > 0:
            d = ref[i] - lp[i]
            ell = ell + beta * (torch.exp(d) - d - 1)
        total = total + ell
        per_seq.setdefault(int(seq[i]), []).append(ell)
    if norm == "token":
        return total / (denom if denom is not None else max(sum(mask), 1))
    means = [sum(v) / len(v) for v in per_seq.values()]
    return sum(means) / (denom if denom is not None else max(len(means), 1))


# ---- group_advantages -------------------------------------------------------------------------


def test_advantages_population_std():
    adv = group_advantages([0.0, 1.0, 1.0, 0.0])  # mean 0.5, population std 0.5
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, 1.0, -1.0]), atol=1e-5)


def test_advantages_dr_grpo_no_std():
    adv = group_advantages(torch.tensor([0.0, 2.0, 1.0]), scale_by_std=False)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, 0.0]))


@pytest.mark.parametrize("rewards", [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0], [3.0]])
def test_advantages_equal_rewards_are_zero(rewards):
    for scale in (True, False):
        adv = group_advantages(rewards, scale_by_std=scale)
        assert not torch.isnan(adv).any() and torch.equal(adv, torch.zeros(len(rewards)))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_refused_not_turned_into_nan_advantages(bad):
    # A NaN advantage makes the whole batch's loss NaN: the step is skipped and every other group lost.
    with pytest.raises(ValueError, match="non-finite reward"):
        group_advantages([1.0, bad, 0.0])


# ---- grpo_loss: one token per branch -----------------------------------------------------------


def test_unclipped():
    loss, grad, m = one_token(math.log(1.1), 0.0, 0.0, 1.0)  # r = 1.1 inside [0.8, 1.28], w = 1
    assert loss == pytest.approx(-1.1) and grad == pytest.approx(-1.1)  # d(-rA)/dlogp = -rA
    assert m["clip_low"] == 0 and m["clip_high"] == 0


def test_clipped_high_no_gradient():
    loss, grad, m = one_token(math.log(1.5), 0.0, 0.0, 1.0)  # A > 0, r = 1.5 > 1.28
    assert loss == pytest.approx(-1.28) and grad == 0.0
    assert m["clip_high"] == 1 and m["clip_low"] == 0


def test_high_ratio_negative_advantage_not_clipped():
    loss, grad, m = one_token(math.log(1.5), 0.0, 0.0, -1.0)  # min(-1.5, -1.28) = -1.5
    assert loss == pytest.approx(1.5) and grad == pytest.approx(1.5)
    assert m["clip_high"] == 0


def test_unclipped_negative_advantage():
    loss, grad, m = one_token(math.log(0.9), 0.0, 0.0, -1.0)  # r = 0.9 inside, A < 0
    assert loss == pytest.approx(0.9) and grad == pytest.approx(0.9)
    assert m["clip_low"] == 0 and m["clip_high"] == 0


def test_old_logprobs_detached_on_first_pass():
    # caller passes old_logprobs = logprobs without detaching: r must still carry the gradient
    lp = t(-1.0).requires_grad_()
    # (pi_old/mu = e^2 is capped at 2: r = 1, loss = -2 * A, d loss / d logp = -2 * A)
    loss, _ = grpo_loss(lp, lp, t(-3.0), t(2.0), t(1), torch.tensor([0]))
    loss.backward()
    assert loss.item() == pytest.approx(-4.0) and lp.grad.item() == pytest.approx(-4.0)


def test_clipped_low_no_gradient():
    loss, grad, m = one_token(math.log(0.5), 0.0, 0.0, -1.0)  # A < 0, r = 0.5 < 0.8
    assert loss == pytest.approx(0.8) and grad == 0.0
    assert m["clip_low"] == 1 and m["clip_high"] == 0


def test_is_weight_below_cap():
    # pi_old / mu = 1.5 < 2, r = 1: loss = -1.5 * A
    loss, grad, m = one_token(math.log(0.6), math.log(0.6), math.log(0.4), 2.0)
    assert loss == pytest.approx(-3.0) and grad == pytest.approx(-3.0)
    assert m["is_capped"] == 0 and m["is_ratio"].item() == pytest.approx(1.5)


def test_is_capped():
    # pi_old / mu = 3 -> capped at 2; r = 1, A = 1: loss = -2, grad = -2
    loss, grad, m = one_token(math.log(3.0), math.log(3.0), 0.0, 1.0)
    assert loss == pytest.approx(-2.0) and grad == pytest.approx(-2.0)
    assert m["is_capped"] == 1 and m["is_ratio_max"].item() == pytest.approx(3.0)
    assert m["mismatch_kl"].item() == pytest.approx(3.0 - math.log(3.0) - 1.0)  # k3


def test_kl_to_reference():
    # logp = 0, ref = log 2, beta = 0.1, A = 0: k3 = 2 - log 2 - 1, d k3 / d logp = 1 - 2 = -1
    lp = t(0.0).requires_grad_()
    loss, m = grpo_loss(
        lp, t(0), t(0), t(0), t(1), torch.tensor([0]), ref_logprobs=t(math.log(2)), kl_beta=0.1
    )
    loss.backward()
    assert loss.item() == pytest.approx(0.1 * (1 - math.log(2)))
    assert lp.grad.item() == pytest.approx(-0.1)
    assert m["kl_ref"].item() == pytest.approx(1 - math.log(2))


def test_masked_tokens_contribute_nothing():
    # token 1 is a tool token with wild values; the loss must equal token 0 alone
    lp = t(math.log(1.1), 5.0).requires_grad_()
    loss, m = grpo_loss(
        lp, t(0, -5), t(0, -30), t(1, 100), t(1, 0), torch.tensor([0, 0]), entropy=t(0.5, 9.0)
    )
    loss.backward()
    assert loss.item() == pytest.approx(-1.1)
    assert lp.grad.tolist() == pytest.approx([-1.1, 0.0])
    assert m["tokens"] == 1 and m["is_capped"] == 0 and m["entropy"].item() == 0.5
    assert m["is_ratio_max"].item() == 1.0 and m["mismatch_kl"].item() == 0.0


# ---- normalization ----------------------------------------------------------------------------


def test_token_vs_sequence_normalization():
    # seq 0: one token, A = 2; seq 1: three tokens, A = -1; r = w = 1 so each token's loss is -A
    args = (
        t(0, 0, 0, 0),
        t(0, 0, 0, 0),
        t(0, 0, 0, 0),
        t(2, -1, -1, -1),
        t(1, 1, 1, 1),
        torch.tensor([0, 1, 1, 1]),
    )
    token, _ = grpo_loss(*args, loss_norm="token")
    seq, _ = grpo_loss(*args, loss_norm="sequence")
    assert token.item() == pytest.approx((-2 + 3) / 4)  # 0.25
    assert seq.item() == pytest.approx((-2 + 1) / 2)  # -0.5: the short sequence weighs as much
    assert grpo_loss(*args, total_tokens=8)[0].item() == pytest.approx(1 / 8)
    assert grpo_loss(*args, loss_norm="sequence", num_sequences=4)[0].item() == pytest.approx(-1 / 4)
    with pytest.raises(ValueError):
        grpo_loss(*args, loss_norm="seq")  # type: ignore[arg-type]


def test_gradient_accumulation_matches_full_batch():
    # split 2 sequences into 2 micro-batches; with global denominators the summed losses and
    # gradients equal the full batch's
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(7, generator=g, dtype=torch.float64) * 0.3
    old, beh = lp + 0.1 * torch.randn(7, generator=g), lp + 0.1 * torch.randn(7, generator=g)
    adv, mask = t(1, 1, 1, -0.5, -0.5, -0.5, -0.5), t(1, 0, 1, 1, 1, 0, 1)
    seq = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    for norm, kw in [("token", {"total_tokens": mask.sum()}), ("sequence", {"num_sequences": 2})]:
        full_lp = lp.clone().requires_grad_()
        full, _ = grpo_loss(full_lp, old, beh, adv, mask, seq, loss_norm=norm, **kw)
        full.backward()
        acc_lp = lp.clone().requires_grad_()
        acc = sum(
            grpo_loss(acc_lp[s], old[s], beh[s], adv[s], mask[s], seq[s] - seq[s][0], loss_norm=norm, **kw)[0]
            for s in (slice(0, 3), slice(3, 7))
        )
        acc.backward()
        assert acc.item() == pytest.approx(full.item())
        assert torch.allclose(acc_lp.grad, full_lp.grad)


# ---- against the plain loop -------------------------------------------------------------------


def check_against_reference(lens, lp, old, beh, adv_seq, mask, ref, beta, norm, denom):
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    adv = torch.tensor(adv_seq, dtype=torch.float64)[seq]
    lp_v = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    kw = {"total_tokens": denom} if norm == "token" else {"num_sequences": denom}
    loss, _ = grpo_loss(
        lp_v, t(*old), t(*beh), adv, t(*mask), seq, loss_norm=norm, ref_logprobs=t(*ref), kl_beta=beta, **kw
    )
    loss.backward()
    lp_r = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in lp]
    expected = reference(lp_r, old, beh, adv.tolist(), mask, seq.tolist(), ref, beta, norm, denom)
    if not torch.is_tensor(expected):  # every token masked
        assert loss.item() == 0.0 and lp_v.grad.abs().sum() == 0
        return
    expected.backward()
    grad_r = [0.0 if x.grad is None else x.grad.item() for x in lp_r]
    assert loss.item() == pytest.approx(expected.item(), abs=1e-9)
    assert lp_v.grad.tolist() == pytest.approx(grad_r, abs=1e-9)


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_gradients_match_reference_loop(norm):
    g = torch.Generator().manual_seed(1)
    lens = [3, 5, 2]
    n = sum(lens)
    lp = (torch.randn(n, generator=g) * 0.4 - 1).tolist()
    old = [x + 0.3 * y for x, y in zip(lp, torch.randn(n, generator=g).tolist())]
    beh = [x + 0.8 * y for x, y in zip(old, torch.randn(n, generator=g).tolist())]
    ref = [x + 0.2 * y for x, y in zip(lp, torch.randn(n, generator=g).tolist())]
    mask = [1, 1, 0, 1, 0, 1, 1, 1, 1, 1]
    check_against_reference(lens, lp, old, beh, [1.0, -0.7, 0.3], mask, ref, 0.05, norm, None)


@st.composite
def batches(draw):
    lens = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    n = sum(lens)
    f = st.floats(-3, 0, allow_nan=False)
    lp, old, beh, ref = (draw(st.lists(f, min_size=n, max_size=n)) for _ in range(4))
    adv = draw(st.lists(st.floats(-2, 2, allow_nan=False), min_size=len(lens), max_size=len(lens)))
    mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    beta = draw(st.sampled_from([0.0, 0.1]))
    norm = draw(st.sampled_from(["token", "sequence"]))
    denom = draw(st.sampled_from([None, 7.0]))
    return lens, lp, old, beh, adv, mask, ref, beta, norm, denom


@settings(max_examples=200, deadline=None)
@given(batches())
def test_property_matches_reference_loop(batch):
    check_against_reference(*batch)


# ---- mini-batches × micro-batches: the accounting train_step relies on --------------------------


@st.composite
def split_batches(draw):
    """A batch of sequences cut into contiguous mini-batches, each cut into contiguous micro-batches."""
    lens = draw(st.lists(st.integers(1, 4), min_size=2, max_size=6))
    n = sum(lens)
    f = st.floats(-3, 0, allow_nan=False)
    lp, old, beh = (draw(st.lists(f, min_size=n, max_size=n)) for _ in range(3))
    adv = draw(st.lists(st.floats(-2, 2, allow_nan=False), min_size=len(lens), max_size=len(lens)))
    mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    cuts = sorted(draw(st.sets(st.integers(1, len(lens) - 1), max_size=len(lens) - 1)))
    minis = [range(a, b) for a, b in zip([0, *cuts], [*cuts, len(lens)])]
    micro_cuts = [sorted(draw(st.sets(st.integers(1, len(m)), max_size=len(m)))) for m in minis]
    norm = draw(st.sampled_from(["token", "sequence"]))
    return lens, lp, old, beh, adv, mask, minis, micro_cuts, norm


@settings(max_examples=200, deadline=None)
@given(split_batches())
def test_mini_and_micro_batches_add_up_to_the_reference(batch):
    """Each mini-batch's micro-batch losses, with that mini-batch's denominators, add up to the plain
    loop over the mini-batch; the metric sums over all micro-batches of all mini-batches are the batch's
    (tokens, clip counts), so the fractions train_step reports are exact."""
    lens, lp, old, beh, adv, mask, minis, micro_cuts, norm = batch
    starts = [sum(lens[:k]) for k in range(len(lens) + 1)]
    tok = lambda seqs: [i for k in seqs for i in range(starts[k], starts[k + 1])]  # noqa: E731
    tokens = clip_low = clip_high = 0.0
    for mini, cuts in zip(minis, micro_cuts):
        idx = tok(mini)
        n_tok = sum(mask[i] for i in idx)
        n_seq = sum(1 for k in mini if any(mask[i] for i in tok([k])))
        denom = {"total_tokens": max(n_tok, 1)} if norm == "token" else {"num_sequences": max(n_seq, 1)}
        total = 0.0
        for a, b in zip([0, *cuts], [*cuts, len(mini)]):
            if a == b:
                continue
            seqs = list(mini)[a:b]
            ids = tok(seqs)
            seq = torch.tensor([j for j, k in enumerate(seqs) for _ in range(lens[k])])
            adv_mb = t(*[adv[k] for k in seqs for _ in range(lens[k])])
            loss, m = grpo_loss(
                *(t(*[xs[i] for i in ids]) for xs in (lp, old, beh)), adv_mb, t(*[mask[i] for i in ids]), seq,
                loss_norm=norm, **denom,
            )  # fmt: skip
            total += loss.item()
            tokens, clip_low, clip_high = (
                tokens + m["tokens"],
                clip_low + m["clip_low"],
                clip_high + m["clip_high"],
            )
        adv_tok = [adv[k] for k in mini for _ in range(lens[k])]
        seq_all = [k for k in mini for _ in range(lens[k])]
        expected = reference(
            [torch.tensor(lp[i], dtype=torch.float64) for i in idx], [old[i] for i in idx],
            [beh[i] for i in idx], adv_tok, [mask[i] for i in idx], seq_all, norm=norm,
            denom=max(n_tok, 1) if norm == "token" else max(n_seq, 1),
        )  # fmt: skip
        assert total == pytest.approx(float(expected), abs=1e-9)
    ratio = [math.exp(a - b) for a, b in zip(lp, old)]
    adv_all = [adv[k] for k in range(len(lens)) for _ in range(lens[k])]
    assert tokens == sum(mask)
    assert clip_low == sum(1 for i, r in enumerate(ratio) if mask[i] and adv_all[i] < 0 and r < 0.8)
    assert clip_high == sum(1 for i, r in enumerate(ratio) if mask[i] and adv_all[i] > 0 and r > 1.28)


# ---- what masked positions and equal rewards contribute: exactly nothing ------------------------------


@pytest.mark.parametrize("rewards", [[0.7] * 3, [0.7] * 7, [0.1] * 12, [0.1] * 3])
def test_equal_non_dyadic_rewards_give_exactly_zero_advantages(rewards):
    """The float64 mean of three or seven 0.7s, or of twelve 0.1s, is not the reward itself (asserted, so
    the test keeps exercising the guard whatever torch's summation order): divided by std + eps that
    rounding was an advantage of ~5e-2."""
    r = torch.tensor(rewards, dtype=torch.float64)
    assert (r != r.mean()).all()
    for scale in (True, False):
        assert torch.equal(group_advantages(rewards, scale_by_std=scale), torch.zeros(len(rewards)))


@pytest.mark.parametrize("norm", ["token", "sequence"])
@pytest.mark.parametrize("junk", [float("-inf"), float("nan"), float("inf")])
def test_masked_positions_contribute_nothing_whatever_their_logprob(norm, junk):
    """A truncated distribution gives −inf to prompt tokens outside its kept set (the first token of
    each packed sequence, any prompt token): the loss, its metrics and its gradient are those of the
    same batch with 0 there, and finite."""
    gen = torch.Generator().manual_seed(0)
    T = 12
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 1], dtype=torch.float64)
    seq = torch.tensor([0] * 6 + [1] * 6)
    base = -torch.rand(T, generator=gen, dtype=torch.float64)
    beh = base - 0.1 * torch.rand(T, generator=gen, dtype=torch.float64)
    adv = torch.where(seq == 0, 0.5, -1.25).double()
    ref = base + 0.05
    kw = dict(loss_norm=norm, kl_beta=0.1, entropy=torch.rand(T, generator=gen, dtype=torch.float64))

    def run(fill):
        lp = torch.where(mask.bool(), base, fill).requires_grad_()
        poisoned = lambda x: torch.where(mask.bool(), x, fill)  # noqa: E731
        loss, m = grpo_loss(lp, poisoned(base), poisoned(beh), poisoned(adv), mask, seq,
                            ref_logprobs=poisoned(ref), **kw)  # fmt: skip
        loss.backward()
        return loss, lp.grad, m

    loss0, grad0, m0 = run(torch.tensor(0.0, dtype=torch.float64))
    loss, grad, m = run(torch.tensor(junk, dtype=torch.float64))
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.equal(loss, loss0) and torch.equal(grad, grad0)
    assert torch.equal(grad[~mask.bool()], torch.zeros(int((mask == 0).sum()), dtype=torch.float64))
    for k in m0:
        assert torch.equal(m[k], m0[k]), k


# ---- group_advantages against plain Python ------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(st.sampled_from([0.0, 0.1, 0.7, 1.0, -0.9]), st.floats(-100, 100, allow_nan=False)),
        min_size=1,
        max_size=16,
    ),
    st.booleans(),
)
def test_group_advantages_match_a_plain_python_loop(rewards, scale_by_std):
    """(r − mean) / (population std + 1e-6), or r − mean (--no-scale-rewards), written with the
    statistics module, exact 0 for a group whose rewards are all equal, G = 1 and G = 2 included."""
    import statistics

    got = group_advantages(rewards, scale_by_std=scale_by_std)
    assert got.dtype == torch.float32 and got.shape == (len(rewards),)
    if len(set(rewards)) == 1:
        assert torch.equal(got, torch.zeros(len(rewards)))
        return
    mean = statistics.fmean(rewards)
    scale = statistics.pstdev(rewards) + 1e-6 if scale_by_std else 1.0
    expected = [(r - mean) / scale for r in rewards]
    assert got.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-5)
    if len(rewards) == 2 and scale_by_std:  # G = 2: ±1 up to the eps, whatever the two rewards
        half_gap = abs(rewards[0] - rewards[1]) / 2
        assert abs(got[0].item()) == pytest.approx(half_gap / (half_gap + 1e-6), rel=1e-6)
