"""The RL maths against values worked out by hand (comments show the arithmetic)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.rl.advantages import (
    NEVER_TRAINED,
    batch_mean_advantages,
    subgroup_advantages,
    training_count_weights,
)
from pipeline.rl.losses import aggregate, approx_kl_sum, policy_loss, token_weights
from pipeline.rl.policy_step import StepResult

SQRT_HALF = math.sqrt(0.5)


def test_subgroup_advantages_mean_std_normalises_inside_each_subgroup():
    # group 0: guided [1, 0] free [1, 1]; group 1: guided [0, 0] free [1, 0]
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    guided = torch.tensor([True, True, False, False, True, True, False, False])
    # [1, 0]: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = sqrt(0.5); (1 - 0.5) / sqrt(0.5) = sqrt(0.5)
    expected = torch.tensor([SQRT_HALF, -SQRT_HALF, 0.0, 0.0, 0.0, 0.0, SQRT_HALF, -SQRT_HALF])
    got = subgroup_advantages(rewards, groups, guided, "mean_std", eps=0.0)
    torch.testing.assert_close(got, expected)


def test_subgroup_advantages_are_not_normalised_across_the_whole_group():
    # whole group [1, 0, 0, 0] would give the success 1.5; its guided subgroup [1, 0] gives sqrt(0.5)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    got = subgroup_advantages(rewards, torch.zeros(4, dtype=torch.long), torch.tensor([True, True, False, False]),
                              "mean_std", eps=0.0)
    torch.testing.assert_close(got, torch.tensor([SQRT_HALF, -SQRT_HALF, 0.0, 0.0]))


def test_subgroup_advantages_of_three_with_eps():
    # [1, 0, 0]: mean 1/3; deviations 2/3, -1/3, -1/3; unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3; std 0.57735
    rewards = torch.tensor([1.0, 0.0, 0.0])
    groups = torch.zeros(3, dtype=torch.long)
    guided = torch.ones(3, dtype=torch.bool)
    std = math.sqrt(1 / 3)
    torch.testing.assert_close(subgroup_advantages(rewards, groups, guided, "mean_std", eps=0.0),
                               torch.tensor([2 / 3 / std, -1 / 3 / std, -1 / 3 / std]))
    torch.testing.assert_close(subgroup_advantages(rewards, groups, guided, "mean_std", eps=0.1),
                               torch.tensor([2 / 3 / (std + 0.1), -1 / 3 / (std + 0.1), -1 / 3 / (std + 0.1)]))
    torch.testing.assert_close(subgroup_advantages(rewards, groups, guided, "mean"),
                               torch.tensor([2 / 3, -1 / 3, -1 / 3]))


def test_zero_variance_and_singleton_subgroups_get_exactly_zero():
    rewards = torch.tensor([1.0, 1.0, 0.5])
    groups = torch.tensor([0, 0, 1])
    guided = torch.tensor([True, True, False])
    got = subgroup_advantages(rewards, groups, guided, "mean_std", eps=0.0)  # 0 / (0 + 0) would be NaN
    assert got.tolist() == [0.0, 0.0, 0.0]


def test_unknown_advantage_norm_lists_the_valid_ones():
    with pytest.raises(ValueError, match="mean_std, mean"):
        subgroup_advantages(torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.bool), "std")


def test_batch_mean_advantages():
    # mean of [1, -1, 0.5, -0.5, 1] is 0.2
    got = batch_mean_advantages(torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0]))
    torch.testing.assert_close(got, torch.tensor([0.8, -1.2, 0.3, -0.7, 0.8]))


def test_training_count_weights_eq7():
    counts = torch.tensor([0, 3, 1, 1, 5])
    since = torch.tensor([NEVER_TRAINED, 2.0, 0.0, 5.0, 1.0])
    # never trained: (1+0)^-0.5 = 1; (1+3)^-0.5 = 0.5; trained this step (0 < delta 1): 0; 2^-0.5; 6^-0.5
    expected = torch.tensor([1.0, 0.5, 0.0, SQRT_HALF, 6 ** -0.5])
    torch.testing.assert_close(training_count_weights(counts, since, alpha=0.5, delta=1), expected)
    # delta 3 silences everything trained less than 3 steps ago
    torch.testing.assert_close(training_count_weights(counts, since, alpha=0.5, delta=3),
                               torch.tensor([1.0, 0.0, 0.0, SQRT_HALF, 0.0]))


def _ratios(values: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs whose ratio to a behaviour of log(0.25) is `values`."""
    behaviour = torch.full((len(values), len(values[0])), math.log(0.25))
    logp = (behaviour + torch.log(torch.tensor(values))).requires_grad_(True)
    return logp, behaviour


def test_grpo_clipped_objective_by_hand():
    # row 0: A=+1, ratios [1.5, 0.5]; row 1: A=-1, ratios [0.5, 1.5]; eps 0.2 / 0.2
    # per token -min(r*A, clip(r)*A): [-min(1.5, 1.2), -min(0.5, 0.8)] = [-1.2, -0.5]
    #                                 [-min(-0.5, -0.8), -min(-1.5, -1.2)] = [0.8, 1.5]
    logp, behaviour = _ratios([[1.5, 0.5], [0.5, 1.5]])
    out = policy_loss("grpo", logp, behaviour, torch.tensor([1.0, -1.0]), torch.ones(2, 2),
                      eps_low=0.2, eps_high=0.2, aggregation="token-mean")
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 1.5) / 4)  # 0.15
    assert (out.clipped_low, out.clipped_high, out.tokens, out.clip_fraction) == (1, 1, 4, 0.5)
    out.loss.backward()
    # clipped tokens have no gradient; d(-r*A)/dlogp = -r*A, over 4 tokens
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5 / 4], [0.0, 1.5 / 4]]))


def test_grpo_asymmetric_bounds():
    # eps_high 0.28 lets a ratio of 1.25 through unclipped; eps_low 0.1 clips a ratio of 0.85 with A<0
    logp, behaviour = _ratios([[1.25], [0.85]])
    out = policy_loss("grpo", logp, behaviour, torch.tensor([1.0, -1.0]), torch.ones(2, 1),
                      eps_low=0.1, eps_high=0.28, aggregation="token-mean")
    # [-1.25, -min(-0.85, -0.9)] = [-1.25, 0.9]
    assert out.loss.item() == pytest.approx((-1.25 + 0.9) / 2)
    assert (out.clipped_low, out.clipped_high) == (1, 0)


def test_aggregations_by_hand_with_a_mask():
    token_loss = torch.tensor([[-1.2, -0.5], [0.8, 99.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # token-mean: (-1.2 - 0.5 + 0.8) / 3 = -0.3; seq-mean-token-mean: ((-1.7 / 2) + 0.8 / 1) / 2 = -0.025;
    # seq-mean-token-sum-norm over 4 tokens: (-1.7 / 4 + 0.8 / 4) / 2 = -0.1125
    def loss(aggregation: str, norm_tokens: int | None = None) -> float:
        weights = torch.tensor(token_weights(aggregation, [2, 1], norm_tokens=norm_tokens))
        return aggregate(token_loss, mask, weights).item()

    assert loss("token-mean") == pytest.approx(-0.3)
    assert loss("seq-mean-token-mean") == pytest.approx(-0.025)
    assert loss("seq-mean-token-sum-norm", norm_tokens=4) == pytest.approx(-0.1125)
    args = (torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2), mask)
    with pytest.raises(ValueError, match="positive norm_tokens"):
        policy_loss("grpo", *args, eps_low=0.2, eps_high=0.2, aggregation="seq-mean-token-sum-norm")


def test_per_episode_weights_by_hand():
    # Two episodes: a 4-turn failure of 3 tokens a turn (12 tokens, samples 0-3) and a 1-turn success of 3 tokens
    # (sample 4). token-mean gives each of the 15 tokens 1/15, so the failure weighs 12/15 = 4x the success;
    # seq-mean-token-mean gives each episode 1/2: 1/(12*2) per failure token, 1/(3*2) per success token;
    # seq-mean-token-sum-norm with 12: 1/(12*2) per token, so each episode weighs its own length: 12 : 3.
    lengths, sequences = [3, 3, 3, 3, 3], [0, 0, 0, 0, 1]
    assert token_weights("token-mean", lengths, sequences) == [1 / 15] * 5
    assert token_weights("seq-mean-token-mean", lengths, sequences) == [1 / 24] * 4 + [1 / 6]
    assert token_weights("seq-mean-token-sum-norm", lengths, sequences, norm_tokens=12) == [1 / 24] * 5
    # an episode that weighs one unit under seq-mean-token-mean: its tokens' weights sum to 1 / episodes
    weights = token_weights("seq-mean-token-mean", [2, 5, 1, 4], [7, 7, 3, 9])
    assert [sum(w * n for w, n, s in zip(weights, [2, 5, 1, 4], [7, 7, 3, 9], strict=True) if s == e)
            for e in (7, 3, 9)] == pytest.approx([1 / 3] * 3)
    # a sequence without tokens counts in no denominator; each sample alone when no sequences are given
    assert token_weights("seq-mean-token-mean", [2, 0, 4]) == [1 / 4, 1 / 2, 1 / 8]
    assert token_weights("seq-mean-token-sum-norm", [2, 0, 4], norm_tokens=10) == [1 / 20] * 3
    with pytest.raises(ValueError, match="2 sequence ids for 3 samples"):
        token_weights("token-mean", [1, 2, 3], [0, 1])


def test_micro_batches_with_batch_totals_sum_to_the_full_loss():
    torch.manual_seed(0)
    logp = torch.randn(4, 5) * 0.1 - 2
    behaviour = logp + torch.randn(4, 5) * 0.3
    advantages = torch.tensor([1.0, -0.5, 0.25, 2.0])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    sequences = [0, 1, 1, 2]  # rows 1 and 2 are turns of one episode, split across the two micro-batches
    for variant in ("grpo", "cispo"):
        for aggregation in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            weights = torch.tensor(token_weights(aggregation, [3, 5, 1, 2], sequences, norm_tokens=8))
            kwargs = dict(eps_low=0.2, eps_high=0.2, aggregation=aggregation)
            full = policy_loss(variant, logp, behaviour, advantages, mask, weights=weights, **kwargs).loss
            parts = sum(policy_loss(variant, logp[i:i + 2], behaviour[i:i + 2], advantages[i:i + 2], mask[i:i + 2],
                                    weights=weights[i:i + 2], **kwargs).loss for i in (0, 2))
            assert parts.item() == pytest.approx(full.item(), abs=1e-6), (variant, aggregation)
    # rows as their own sequences by default: seq-mean-token-mean is the mean of the row means
    token = policy_loss("grpo", logp, behaviour, advantages, mask, eps_low=0.2, eps_high=0.2,
                        aggregation="seq-mean-token-mean")
    rows = [policy_loss("grpo", logp[i:i + 1], behaviour[i:i + 1], advantages[i:i + 1], mask[i:i + 1],
                        eps_low=0.2, eps_high=0.2, aggregation="token-mean").loss for i in range(4)]
    assert token.loss.item() == pytest.approx(sum(r.item() for r in rows) / 4, abs=1e-6)


def test_cispo_by_hand():
    # behaviour p=0.2 for both tokens; current p 0.3 (rho 1.5 -> weight 1.1) and 0.1 (rho 0.5 -> weight 0.9); A=+2
    # loss = mean(-1.1*2*log 0.3, -0.9*2*log 0.1) = mean(2.64874, 4.14465) = 3.39670
    logp = torch.log(torch.tensor([[0.3, 0.1]])).requires_grad_(True)
    behaviour = torch.log(torch.tensor([[0.2, 0.2]]))
    out = policy_loss("cispo", logp, behaviour, torch.tensor([2.0]), torch.ones(1, 2),
                      eps_low=0.1, eps_high=0.1, aggregation="token-mean")
    expected = (-1.1 * 2 * math.log(0.3) - 0.9 * 2 * math.log(0.1)) / 2
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert (out.clipped_low, out.clipped_high) == (1, 1)
    out.loss.backward()
    # the clipped weight is a constant (stop-gradient): d/dlogp = -w*A/2, and clipped tokens still get gradient
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.1, -0.9]]))


def test_cispo_inside_the_band_is_plain_policy_gradient():
    logp = torch.log(torch.tensor([[0.21, 0.19]])).requires_grad_(True)  # rho 1.05 and 0.95: inside 0.9..1.1
    behaviour = torch.log(torch.tensor([[0.2, 0.2]]))
    out = policy_loss("cispo", logp, behaviour, torch.tensor([-1.0]), torch.ones(1, 2),
                      eps_low=0.1, eps_high=0.1, aggregation="token-mean")
    assert out.clip_fraction == 0.0
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[1.05 / 2, 0.95 / 2]]))


def test_unknown_loss_variant_and_aggregation_list_the_valid_ones():
    args = (torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1))
    with pytest.raises(ValueError, match=r"unknown loss variant 'ppo'; valid values: grpo, cispo"):
        policy_loss("ppo", *args, eps_low=0.2, eps_high=0.2, aggregation="token-mean")
    with pytest.raises(ValueError, match=r"valid values: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm"):
        policy_loss("grpo", *args, eps_low=0.2, eps_high=0.2, aggregation="sum")



def test_approx_kl_is_k3_summed_over_the_response_tokens_by_hand():
    # r = pi / mu: 0.5 / 0.25 = 2 gives (2 - 1) - ln 2 = 0.306853; 0.25 / 0.5 = 1/2 gives -1/2 + ln 2 = 0.193147;
    # r = 1 gives 0; the padding (mask 0) adds nothing however far apart its values are.
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.3, 0.9]]))
    behaviour = torch.log(torch.tensor([[0.25, 0.5], [0.3, 0.1]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert approx_kl_sum(logp, behaviour, mask) == pytest.approx((1 - math.log(2)) + (math.log(2) - 0.5), abs=1e-6)
    assert approx_kl_sum(behaviour, behaviour, torch.ones(2, 2)) == 0.0


def test_step_diagnostics_are_per_trained_token_and_per_sample():
    result = StepResult(loss=0.1, tokens=30, trained_tokens=20, sequences=2, clipped_low=1, clipped_high=3,
                        grad_norm=1.0, samples=6, kl_sum=0.5, entropy_sum=40.0)
    assert result.diagnostics() == {"train/clip_fraction": 0.2, "train/response_length": 5.0,
                                    "train/approx_kl": 0.025, "train/entropy": 2.0}
    nothing_trained = StepResult(loss=0.0, tokens=12, trained_tokens=0, sequences=1, clipped_low=0, clipped_high=0,
                                 grad_norm=0.0, samples=3, kl_sum=0.0, entropy_sum=None)
    assert nothing_trained.diagnostics() == {"train/clip_fraction": 0.0, "train/response_length": 4.0}
