"""The aggregations through a real optimiser step of the tiny model: an actor batch's turns weigh per episode.

At a policy's first step on its own samples every ratio is 1, so GRPO's token loss is `-A` on every token and the
batch loss follows from the episodes' advantages and response lengths alone, worked by hand below.
"""

from __future__ import annotations

import pytest

from pipeline.models.settings import TinyModelSettings
from pipeline.models.tiny import build_tiny
from pipeline.rl.policy_step import make_optimizer, policy_step
from pipeline.rl.synthetic import synthetic_trajectories
from pipeline.rl.trainer import actor_samples

TINY = TinyModelSettings(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                         vocab_size=512, corpus_episodes=4)
ADVANTAGES = [1.0, -1.0, 0.5, -0.5]


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_the_step_loss_weighs_episodes_as_the_aggregation_says(aggregation):
    policy = build_tiny(TINY)
    played = synthetic_trajectories(policy, run_id="run", step=1, groups=1, group_size=4, seed=3, turns=3)
    # episodes of 3, 1, 2 and 3 turns, so their response lengths differ
    batch = [t.model_copy(update={"turns": t.turns[:n]}) for t, n in zip(played, [3, 1, 2, 3], strict=True)]
    lengths = [sum(len(turn.response_token_ids) for turn in t.turns) for t in batch]  # each episode's tokens
    assert len(set(lengths)) > 1, "the episodes should differ in length for this test to tell the aggregations apart"
    samples = actor_samples(batch, ADVANTAGES)
    assert [s.sequence for s in samples] == [0, 0, 0, 1, 2, 2, 3, 3, 3]
    result = policy_step(policy, policy.model, make_optimizer(policy.model, 1e-3, 0.0, (0.9, 0.999), 1e-8), samples,
                         variant="grpo", aggregation=aggregation, eps_low=0.2, eps_high=0.2, temperature=1.0,
                         micro_batch_size=5, max_grad_norm=1.0, norm_tokens=20)
    by_episode = [a * n for a, n in zip(ADVANTAGES, lengths, strict=True)]
    expected = {
        "token-mean": -sum(by_episode) / sum(lengths),  # long episodes weigh more
        "seq-mean-token-mean": -sum(ADVANTAGES) / 4,  # = 0: each episode one unit, whatever its length
        "seq-mean-token-sum-norm": -sum(by_episode) / (20 * 4),
    }[aggregation]
    assert result.loss == pytest.approx(expected, abs=1e-4)
    assert (result.sequences, result.tokens) == (4, sum(lengths))
