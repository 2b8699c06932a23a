"""Data-parallel steps: the shards of a batch, the weights a shard's samples carry, the two-shard gradient against the
one-rank gradient on the tiny model, and two real gloo ranks that end every step with the same weights (or fail
together when they do not)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.errors import InvalidArgumentError, RankFailedError
from pipeline.models.checkpoints import weight_hash
from pipeline.models.settings import ModelSettings, TinyModelSettings
from pipeline.models.tiny import build_tiny
from pipeline.rl.data_parallel import DataParallel
from pipeline.rl.policy_step import Sample, accumulate_gradients, shard_indices, weighted_samples
from pipeline.rl.settings import ActorTrainerSettings
from pipeline.rl.trainer_step import TrainerStep

TINY = TinyModelSettings(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                         vocab_size=512, corpus_episodes=2)
SETTINGS = ActorTrainerSettings(model=ModelSettings(tiny=TINY), threads=1, micro_batch_size=2, lr=1e-2)


def _samples() -> list[Sample]:
    """Six turns of four episodes with response lengths 2, 3, 1, 4, 2, 3; the fifth has a zero advantage."""
    lengths, episodes = [2, 3, 1, 4, 2, 3], [0, 0, 1, 2, 3, 3]
    advantages = [1.0, 1.0, -1.0, 0.5, 0.0, -0.5]
    return [Sample(prompt_ids=tuple(range(5 + i, 9 + i)), response_ids=tuple(range(20 + i, 20 + i + n)),
                   behaviour_logprobs=tuple([-6.0] * n), advantage=a, sequence=e)
            for i, (n, e, a) in enumerate(zip(lengths, episodes, advantages, strict=True))]


@pytest.mark.parametrize(("count", "world_size", "shards"), [
    (5, 2, [[0, 2, 4], [1, 3]]),
    (6, 3, [[0, 3], [1, 4], [2, 5]]),
    (2, 3, [[0], [1], []]),
    (4, 1, [[0, 1, 2, 3]]),
])
def test_shards_are_every_nth_sample_from_the_rank(count, world_size, shards):
    assert [shard_indices(count, rank, world_size) for rank in range(world_size)] == shards


@pytest.mark.parametrize("count", range(12))
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_the_shards_partition_the_batch(count, world_size):
    shards = [shard_indices(count, rank, world_size) for rank in range(world_size)]
    assert sorted(i for shard in shards for i in shard) == list(range(count))  # every sample once
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


@pytest.mark.parametrize(("rank", "world_size"), [(2, 2), (-1, 2), (0, 0)])
def test_a_rank_outside_the_group_is_refused(rank, world_size):
    with pytest.raises(InvalidArgumentError, match="need 0 <= rank < world_size"):
        shard_indices(4, rank, world_size)


def test_a_shard_keeps_the_whole_batch_weights():
    """token-mean over the batch's 15 tokens (the zero-advantage turn's 2 tokens count, it trains no gradient):
    every weight is 1/15, on whichever rank its sample lands, not 1/(tokens of the shard)."""
    trained = weighted_samples(_samples(), "token-mean")
    assert [s.response_ids[0] - 20 for s, _ in trained] == [0, 1, 2, 3, 5]  # the sample index; 4 has advantage 0
    assert [w for _, w in trained] == [1 / 15] * 5
    shard_1 = [trained[i] for i in shard_indices(len(trained), 1, 2)]
    assert [(s.response_ids[0] - 20, w) for s, w in shard_1] == [(1, 1 / 15), (3, 1 / 15)]
    # seq-mean-token-mean: episodes of 5, 1, 4 and 5 tokens, 4 episodes: 1/20, 1/20, 1/4, 1/16, 1/20
    weights = [w for _, w in weighted_samples(_samples(), "seq-mean-token-mean")]
    assert weights == [1 / 20, 1 / 20, 1 / 4, 1 / 16, 1 / 20]


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_two_shard_gradients_sum_to_the_one_rank_gradient():
    torch.manual_seed(0)
    policy = build_tiny(TINY)
    trained = weighted_samples(_samples(), "token-mean")
    options: dict[str, Any] = {"variant": "grpo", "aggregation": "token-mean", "eps_low": 0.2, "eps_high": 0.2,
                               "temperature": 1.0, "micro_batch_size": 2}
    policy.model.zero_grad(set_to_none=True)
    loss = accumulate_gradients(policy, trained, **options).loss
    whole = _gradients(policy.model)
    shard_losses, shard_grads = [], []
    for rank in range(2):
        policy.model.zero_grad(set_to_none=True)
        shard_loss = accumulate_gradients(policy, [trained[i] for i in shard_indices(len(trained), rank, 2)],
                                                **options).loss
        shard_losses.append(shard_loss)
        shard_grads.append(_gradients(policy.model))
    assert set(shard_grads[0]) == set(shard_grads[1]) == set(whole)
    assert sum(shard_losses) == pytest.approx(loss, abs=1e-6)
    for name, gradient in whole.items():
        torch.testing.assert_close(shard_grads[0][name] + shard_grads[1][name], gradient, rtol=1e-5, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in whole.values())


def _rank(rank: int, store: str, samples: list[Sample], results: Any) -> None:
    """One of two gloo ranks: two steps together, then rank 1's weights are disturbed and the third step fails."""
    torch.manual_seed(0)
    update = TrainerStep(build_tiny(TINY), SETTINGS, 1.0)
    parallel = DataParallel.over_file(Path(store), rank, 2, timeout_s=60)
    hashes = []
    try:
        for step in range(3):
            if step == 2 and rank == 1:
                with torch.no_grad():
                    next(update.policy.model.parameters()).add_(1.0)
            try:
                result = update.run(samples, "grpo", group=parallel) if step < 2 else None
                if result is not None:
                    parallel.agree(weight_hash(update.policy.model), f"step {step}")
                    hashes.append((weight_hash(update.policy.model), result.loss, result.grad_norm))
                else:
                    parallel.agree(weight_hash(update.policy.model), "before step 2")
            except RankFailedError as exc:
                results.put((rank, hashes, str(exc)))
                return
        results.put((rank, hashes, None))
    finally:
        parallel.close()


def test_two_gloo_ranks_end_each_step_with_equal_weights_and_fail_together_when_they_differ(tmp_path):
    samples = _samples()
    torch.manual_seed(0)
    one = TrainerStep(build_tiny(TINY), SETTINGS, 1.0)
    single = [one.run(samples, "grpo") for _ in range(2)]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_rank, args=(rank, str(tmp_path / "store"), samples, results))
             for rank in range(2)]
    for process in ranks:
        process.start()
    found = {rank: (hashes, error) for rank, hashes, error in (results.get(timeout=240) for _ in ranks)}
    for process in ranks:
        process.join(timeout=60)
    assert [process.exitcode for process in ranks] == [0, 0]
    (hashes_0, error_0), (hashes_1, error_1) = found[0], found[1]
    assert len(hashes_0) == 2 and [h for h, _, _ in hashes_0] == [h for h, _, _ in hashes_1]  # bit-identical
    for (_, loss, grad_norm), result in zip(hashes_0, single, strict=True):  # the one-rank step, up to float order
        assert loss == pytest.approx(result.loss, abs=1e-6)
        assert grad_norm == pytest.approx(result.grad_norm, rel=1e-5)
    for error in (error_0, error_1):
        assert error is not None and "before step 2: the 2 ranks hold different weights" in error
