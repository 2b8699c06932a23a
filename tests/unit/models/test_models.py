"""The policy models: the tiny preset's determinism, sampling (reproducible, batch-independent, stop rules), log-probs
that agree between sampling and re-scoring, both architectures, and the vLLM adapter's missing-extra error.
Checkpoints are in test_checkpoints.py.

Run: pytest tests/unit/models/test_models.py -q   (CPU, ~15 s)
"""

from __future__ import annotations

import sys

import pytest
import torch
from pydantic import ValidationError
from tiny_models import SMALL

from pipeline.errors import ConfigError, InvalidArgumentError
from pipeline.models import (
    Generation,
    SamplingParams,
    TransformersPolicy,
    build_tiny,
    tokenizer_corpus,
    train_tokenizer,
    weight_hash,
)
from pipeline.models.base import stream_seed

PROMPTS = [
    "Goal: reach the staircase down\nObservation:\n|.@.|\n|..>|\nAction:",
    "Action:",
    "Experience: walls block you; go around them.\n<answer>",
    "Observation:\n-----\n|@..|\n-----\nMessage: It's solid stone.\nAction: north\nAction:",
]


def rows(seed: int, n: int = len(PROMPTS)) -> list[int]:
    """Row seeds for a test call of `n` prompts (all of PROMPTS by default): one stream per (seed, row)."""
    return [stream_seed("test", seed, row) for row in range(n)]


def _batch_logprobs(policy: TransformersPolicy, generations: list[Generation],
                    temperature: float) -> list[torch.Tensor]:
    return policy.token_logprobs([g.prompt_token_ids for g in generations], [g.token_ids for g in generations],
                                 temperature)


# -- the tiny preset ----------------------------------------------------------------------------------------------


def test_tokenizer_corpus_is_deterministic_and_seeded() -> None:
    first, again = tokenizer_corpus(SMALL), tokenizer_corpus(SMALL)
    assert first == again
    assert len(first) > SMALL.corpus_episodes  # one text per episode, then the template lines
    reseeded = tokenizer_corpus(SMALL.model_copy(update={"seed": 1}))
    assert first[: SMALL.corpus_episodes] != reseeded[: SMALL.corpus_episodes]
    episode = first[0]
    assert episode.startswith("Environment: MiniHack-Room-Random-5x5-v0\nGoal: reach the staircase down\n"
                              "Observation:\n")
    assert "@" in episode and "Action: " in episode
    assert "Experience:" in first and "SUCCESS" in first and "FAILURE" in first
    assert any('{"op": "refine", "id": 1' in line for line in first)


def test_same_settings_give_identical_weights_and_vocabulary(policy: TransformersPolicy, corpus: list[str]) -> None:
    again = build_tiny(SMALL, corpus=corpus)
    assert weight_hash(again.model) == weight_hash(policy.model)
    assert again.tokenizer.get_vocab() == policy.tokenizer.get_vocab()
    reseeded = build_tiny(SMALL.model_copy(update={"seed": 1}), corpus=corpus)
    assert weight_hash(reseeded.model) != weight_hash(policy.model)


def test_build_tiny_defaults_to_its_own_corpus_and_leaves_the_global_rng_alone(policy: TransformersPolicy) -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    built = build_tiny(SMALL)
    assert torch.equal(torch.rand(4), expected)
    assert weight_hash(built.model) == weight_hash(policy.model)


def test_tiny_model_shape_and_special_tokens(policy: TransformersPolicy) -> None:
    config = policy.model.config
    assert type(policy.model).__name__ == "Qwen2ForCausalLM"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size) == (64, 2, 4, 2, 128)
    assert config.vocab_size == len(policy.tokenizer) == 512
    assert config.tie_word_embeddings and policy.model.lm_head.weight is policy.model.model.embed_tokens.weight
    assert policy.model.dtype == torch.float32
    assert (policy.tokenizer.pad_token, policy.tokenizer.pad_token_id) == ("<|pad|>", 0)
    assert (policy.tokenizer.eos_token, policy.tokenizer.eos_token_id) == ("<|eos|>", 1)
    assert policy.tokenizer.bos_token is None
    assert (config.pad_token_id, config.eos_token_id) == (0, 1)


@pytest.mark.parametrize("text", [
    PROMPTS[0], PROMPTS[3], "a . b ,  c\n\n  d", 'café ✓ <answer>[{"op": "add", "text": "x"}]</answer>', "",
])
def test_tokenizer_round_trips_text(policy: TransformersPolicy, text: str) -> None:
    ids = policy.encode(text)
    assert all(i not in (0, 1) for i in ids)  # no special tokens added
    assert policy.decode(ids) == text


def test_tokenizer_merges_the_corpus_vocabulary(policy: TransformersPolicy) -> None:
    # Frequent corpus words become single tokens; a word the corpus never saw falls back to pieces.
    assert len(policy.encode("Action")) == 1
    assert len(policy.encode("Observation")) == 1
    assert len(policy.encode("Zyzzogeton")) > 1


def test_tokenizer_saved_and_loaded_is_equal(policy: TransformersPolicy, tmp_path) -> None:
    from transformers import AutoTokenizer

    policy.tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert loaded.get_vocab() == policy.tokenizer.get_vocab()
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.bos_token_id) == (0, 1, None)
    for text in PROMPTS:
        assert loaded.encode(text, add_special_tokens=False) == policy.encode(text)


def test_train_tokenizer_is_deterministic_and_bounded_by_vocab_size(corpus: list[str]) -> None:
    first, again = train_tokenizer(corpus, 300), train_tokenizer(corpus, 300)
    assert first.get_vocab() == again.get_vocab()
    assert len(first) == 300
    assert train_tokenizer(corpus, 400).get_vocab() != first.get_vocab()


# -- sampling -----------------------------------------------------------------------------------------------------


def test_same_seed_gives_identical_generations_and_another_seed_differs(policy: TransformersPolicy) -> None:
    sampling = SamplingParams(max_new_tokens=12)
    first = policy.generate(PROMPTS, sampling, seeds=rows(5))
    assert policy.generate(PROMPTS, sampling, seeds=rows(5)) == first
    other = policy.generate(PROMPTS, sampling, seeds=rows(6))
    assert [g.token_ids for g in other] != [g.token_ids for g in first]


def test_generation_fields_are_consistent(policy: TransformersPolicy) -> None:
    sampling = SamplingParams(max_new_tokens=12)
    for prompt, generation in zip(PROMPTS, policy.generate(PROMPTS, sampling, seeds=rows(5)), strict=True):
        assert generation.prompt_token_ids == tuple(policy.encode(prompt))
        assert 1 <= len(generation.token_ids) <= 12
        assert len(generation.logprobs) == len(generation.token_ids)
        assert all(lp <= 0.0 and lp > -100.0 for lp in generation.logprobs)
        assert generation.text == policy.decode(generation.token_ids)
        ended_by_eos = generation.token_ids[-1] in policy.eos_token_ids
        assert generation.finish_reason == ("stop" if ended_by_eos else "length")
        if generation.finish_reason == "length":
            assert len(generation.token_ids) == 12


OTHERS = [
    "north",
    "Task: MiniHack. Goal: find the key, open the door that leads to the staircase down, then go down.\n"
    "Observation:\n|....|\n|.@..|\nAction:",
    "Goal: x",
    "Observation:\n|.@.|\nAction: south\nAction: south\nAction: west\nAction:",
]
"""More prompts, shorter and longer than PROMPTS[0], so its row is padded differently in every batch below."""


def test_a_row_draws_the_same_tokens_alone_in_any_batch_position_and_split_over_calls(
        policy: TransformersPolicy) -> None:
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0)
    target, seed = PROMPTS[0], stream_seed("test", "target")
    others = PROMPTS[1:] + OTHERS  # 7 other prompts, each with its own seed
    other_seeds = rows(77, len(others))
    alone = policy.generate([target], sampling, seeds=[seed])[0]
    assert len(alone.token_ids) > 1
    for position in (0, 3, 7):
        prompts = [*others[:position], target, *others[position:]]
        seeds = [*other_seeds[:position], seed, *other_seeds[position:]]
        batched = policy.generate(prompts, sampling, seeds=seeds)  # one micro-batch of 8
        split = policy.generate(prompts[:5], sampling, seeds=seeds[:5]) + policy.generate(
            prompts[5:], sampling, seeds=seeds[5:])
        for together in (batched, split):
            assert together[position].token_ids == alone.token_ids
            assert together[position].text == alone.text
            # The batched forward pass is not bitwise batch-invariant on the CPU (the BLAS kernels' row results
            # depend on how many rows a matmul has): the recorded log-probs agree to float error, not bit for bit.
            torch.testing.assert_close(torch.tensor(together[position].logprobs), torch.tensor(alone.logprobs),
                                       atol=1e-5, rtol=0)
        # The other rows are not disturbed by where the target sits either.
        assert [g.token_ids for i, g in enumerate(batched) if i != position] == \
            [g.token_ids for g in policy.generate(others, sampling, seeds=other_seeds)]
    # Across micro-batch boundaries too (3 rows per forward pass).
    three_per_pass = TransformersPolicy(policy.model, policy.tokenizer, micro_batch_size=3)
    prompts, seeds = [*others[:5], target, *others[5:]], [*other_seeds[:5], seed, *other_seeds[5:]]
    assert three_per_pass.generate(prompts, sampling, seeds=seeds)[5].token_ids == alone.token_ids
    # The same prompt twice in one batch with one seed: twice the same tokens; another seed: other tokens.
    twice = policy.generate([target, target, target], sampling, seeds=[seed, seed, seed + 1])
    assert twice[0].token_ids == twice[1].token_ids == alone.token_ids
    assert twice[2].token_ids != alone.token_ids


def test_generate_takes_one_seed_per_prompt_in_range(policy: TransformersPolicy) -> None:
    sampling = SamplingParams(max_new_tokens=2)
    with pytest.raises(InvalidArgumentError, match="2 prompts but 1 seeds"):
        policy.generate(PROMPTS[:2], sampling, seeds=[0])
    for bad in (-1, 2**63, True):
        with pytest.raises(InvalidArgumentError, match=r"\[0, 2\*\*63\)"):
            policy.generate(PROMPTS[:1], sampling, seeds=[bad])  # type: ignore[list-item]
    assert len(policy.generate(PROMPTS[:1], sampling, seeds=[2**63 - 1])) == 1


def test_stream_seed_is_blake2b_of_the_json_parts() -> None:
    import hashlib

    # Hand-checked: the compact JSON array, BLAKE2b with an 8-byte digest, read big-endian, top bit dropped.
    encoded = b'["actor-turn",0,"s000003-g001-k2",0]'
    assert hashlib.blake2b(encoded, digest_size=8).hexdigest() == "90ffeb0a5be2780f"
    assert 0x90FFEB0A5BE2780F >> 1 == 5224164045123304455
    assert stream_seed("actor-turn", 0, "s000003-g001-k2", 0) == 5224164045123304455
    assert stream_seed("actor-turn", 0, "s000003-g001-k2", 1) == 3719143607393822387
    assert stream_seed() == 4090036724241674979  # blake2b-64 of b"[]"
    # Types and boundaries are part of the name: these are three different streams.
    assert len({stream_seed("a", 1), stream_seed("a", "1"), stream_seed("a1")}) == 3
    seeds = {stream_seed("test", seed, row) for seed in range(50) for row in range(64)}
    assert len(seeds) == 50 * 64 and all(0 <= s < 2**63 for s in seeds)
    with pytest.raises(InvalidArgumentError):
        stream_seed("a", 1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        stream_seed("a", True)


def test_prompts_as_token_ids_equal_prompts_as_text(policy: TransformersPolicy) -> None:
    sampling = SamplingParams(max_new_tokens=8)
    as_text = policy.generate(PROMPTS, sampling, seeds=rows(2))
    as_ids = policy.generate([policy.encode(p) for p in PROMPTS], sampling, seeds=rows(2))
    assert as_ids == as_text


def test_greedy_is_deterministic_and_takes_the_argmax(policy: TransformersPolicy) -> None:
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    first = policy.generate(PROMPTS, greedy, seeds=rows(0))
    assert [g.token_ids for g in policy.generate(PROMPTS, greedy, seeds=rows(999))] == [g.token_ids for g in first]
    # Check the argmax by hand, one full forward pass per token, for the first prompt.
    ids = list(first[0].prompt_token_ids)
    with torch.no_grad():
        for token, logprob in zip(first[0].token_ids, first[0].logprobs, strict=True):
            logits = policy.model(input_ids=torch.tensor([ids])).logits[0, -1]
            assert token == int(logits.argmax())
            assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-5)
            ids.append(token)


def test_top_k_1_and_a_tiny_top_p_reduce_to_greedy_but_record_untruncated_logprobs(policy: TransformersPolicy) -> None:
    greedy = policy.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0), seeds=rows(0))
    for sampling in (SamplingParams(max_new_tokens=8, top_k=1), SamplingParams(max_new_tokens=8, top_p=1e-6)):
        restricted = policy.generate(PROMPTS, sampling, seeds=rows(3))
        assert [g.token_ids for g in restricted] == [g.token_ids for g in greedy]
        for r, g in zip(restricted, greedy, strict=True):
            # Temperature 1 and the full distribution: the same values greedy records, not log(1) = 0.
            torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(g.logprobs), atol=1e-6, rtol=0)
            assert max(r.logprobs) < -1.0


def test_top_k_draws_only_among_the_k_most_likely(policy: TransformersPolicy) -> None:
    prompt = policy.encode(PROMPTS[0])
    with torch.no_grad():
        logits = policy.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    top3 = set(torch.topk(logits, 3).indices.tolist())
    first_tokens = {policy.generate([prompt], SamplingParams(max_new_tokens=1, top_k=3),
                                    seeds=rows(s, 1))[0].token_ids[0]
                    for s in range(60)}
    assert first_tokens <= top3
    assert len(first_tokens) >= 2  # a near-uniform untrained model draws more than one of them


def test_max_new_tokens_ends_rows_with_length(policy: TransformersPolicy) -> None:
    for generation in policy.generate(PROMPTS, SamplingParams(max_new_tokens=3), seeds=rows(1)):
        assert len(generation.token_ids) == 3
        assert generation.finish_reason == "length"


def test_stop_string_keeps_tokens_through_the_one_that_completed_it(policy: TransformersPolicy) -> None:
    full = policy.generate(PROMPTS[:1], SamplingParams(max_new_tokens=24), seeds=rows(0, 1))[0]
    assert len(full.token_ids) == 24
    stop = policy.decode(full.token_ids[:10])[-2:]
    assert stop.strip()
    # The same seed draws the same tokens until the stop: the expected output is the shortest prefix holding it.
    cut = next(n for n in range(1, 25) if stop in policy.decode(full.token_ids[:n]))
    assert cut < len(full.token_ids)
    stopped = policy.generate(PROMPTS[:1], SamplingParams(max_new_tokens=24, stop=("never-there", stop)),
                              seeds=rows(0, 1))[0]
    assert stopped.token_ids == full.token_ids[:cut]
    assert stopped.logprobs == full.logprobs[:cut]
    assert stopped.finish_reason == "stop"
    assert stop in stopped.text and stop not in policy.decode(stopped.token_ids[:-1])


def test_stop_token_id_ends_the_row_and_is_kept(policy: TransformersPolicy) -> None:
    full = policy.generate(PROMPTS[:1], SamplingParams(max_new_tokens=24), seeds=rows(0, 1))[0]
    stop_id = full.token_ids[6]
    cut = full.token_ids.index(stop_id) + 1
    stopped = policy.generate(PROMPTS[:1], SamplingParams(max_new_tokens=24, stop_token_ids=(stop_id,)),
                              seeds=rows(0, 1))[0]
    assert stopped.token_ids == full.token_ids[:cut]
    assert stopped.token_ids[-1] == stop_id
    assert stopped.finish_reason == "stop"


def test_eos_ends_the_row_is_kept_and_left_out_of_the_text(policy: TransformersPolicy) -> None:
    eos = policy.tokenizer.eos_token_id
    sampling = SamplingParams(max_new_tokens=24)
    # An untrained model draws eos now and then: take the first of 100 rows (one prompt, 100 seeds) that does.
    ended = next(g for g in policy.generate(PROMPTS[:1] * 100, sampling, seeds=rows(0, 100)) if g.token_ids[-1] == eos)
    assert len(ended.token_ids) < 24
    assert ended.token_ids.count(eos) == 1
    assert ended.finish_reason == "stop"
    assert len(ended.logprobs) == len(ended.token_ids)
    assert ended.text == policy.decode(ended.token_ids[:-1])
    assert "<|eos|>" not in ended.text


def test_finished_rows_stop_while_others_continue(policy: TransformersPolicy) -> None:
    free = policy.generate(PROMPTS, SamplingParams(max_new_tokens=10), seeds=rows(8))
    stop_id = free[0].token_ids[1]
    mixed = policy.generate(PROMPTS, SamplingParams(max_new_tokens=10, stop_token_ids=(stop_id,)), seeds=rows(8))
    assert mixed[0].token_ids == free[0].token_ids[: free[0].token_ids.index(stop_id) + 1]
    for row in range(1, len(PROMPTS)):
        expected = free[row].token_ids
        if stop_id in expected:
            expected = expected[: expected.index(stop_id) + 1]
        assert mixed[row].token_ids == expected


def test_generate_restores_the_training_mode(policy: TransformersPolicy) -> None:
    policy.model.train()
    try:
        policy.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2), seeds=rows(0, 1))
        assert policy.model.training
    finally:
        policy.model.eval()
    policy.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2), seeds=rows(0, 1))
    assert not policy.model.training


def test_empty_prompt_is_rejected(policy: TransformersPolicy) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        policy.generate([""], SamplingParams(), seeds=rows(0, 1))
    assert policy.generate([], SamplingParams(), seeds=rows(0, 0)) == []


@pytest.mark.parametrize("bad", [
    {"max_new_tokens": 0}, {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"stop": ("",)},
    {"unknown": 1},
])
def test_sampling_params_reject_invalid_values(bad: dict) -> None:
    with pytest.raises(ValidationError):
        SamplingParams(**bad)


def test_sampling_params_are_frozen() -> None:
    sampling = SamplingParams()
    with pytest.raises(ValidationError):
        sampling.temperature = 0.5  # type: ignore[misc]
    assert SamplingParams.model_fields["top_p"].description


# -- re-scoring ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_new_tokens=14),
    SamplingParams(max_new_tokens=14, temperature=0.7),
    SamplingParams(max_new_tokens=14, temperature=0.7, top_p=0.9, top_k=40),
], ids=["t1", "t0.7", "t0.7-top_p-top_k"])
def test_token_logprobs_agree_with_the_sampling_logprobs(policy: TransformersPolicy, sampling: SamplingParams) -> None:
    generations = policy.generate(PROMPTS, sampling, seeds=rows(11))
    assert len({len(g.prompt_token_ids) for g in generations}) > 1  # the padding is exercised
    with torch.no_grad():
        scored = _batch_logprobs(policy, generations, sampling.temperature)
    for generation, logps in zip(generations, scored, strict=True):
        assert logps.dtype == torch.float32 and logps.shape == (len(generation.token_ids),)
        torch.testing.assert_close(logps, torch.tensor(generation.logprobs), atol=1e-4, rtol=0)


def test_token_logprobs_at_temperature_0_are_those_at_temperature_1(policy: TransformersPolicy) -> None:
    generations = policy.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0), seeds=rows(0))
    with torch.no_grad():
        at_zero, at_one = _batch_logprobs(policy, generations, 0.0), _batch_logprobs(policy, generations, 1.0)
    for generation, zero, one in zip(generations, at_zero, at_one, strict=True):
        assert torch.equal(zero, one)
        torch.testing.assert_close(zero, torch.tensor(generation.logprobs), atol=1e-4, rtol=0)


def test_token_logprobs_do_not_depend_on_micro_batching(policy: TransformersPolicy) -> None:
    generations = policy.generate(PROMPTS, SamplingParams(max_new_tokens=10), seeds=rows(12))
    one_at_a_time = TransformersPolicy(policy.model, policy.tokenizer, micro_batch_size=1)
    with torch.no_grad():
        together = _batch_logprobs(policy, generations, 1.0)
        apart = _batch_logprobs(one_at_a_time, generations, 1.0)
    for a, b in zip(together, apart, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_token_logprobs_of_an_empty_response_is_empty(policy: TransformersPolicy) -> None:
    prompt = policy.encode(PROMPTS[1])
    out = policy.token_logprobs([prompt, prompt], [[], policy.encode(" north")])
    assert out[0].shape == (0,)
    assert out[1].shape == (len(policy.encode(" north")),)
    assert policy.token_logprobs([prompt], [[]])[0].shape == (0,)


def test_score_gives_the_logprobs_and_the_entropy_of_each_next_token_distribution(policy: TransformersPolicy) -> None:
    """The entropy is that of softmax(logits / T) over the whole vocabulary, where the response token was chosen:
    checked against the full distribution of the model's own logits, one row at a time."""
    generations = policy.generate(PROMPTS[:2], SamplingParams(max_new_tokens=5), seeds=rows(21)[:2])
    prompts, responses = [g.prompt_token_ids for g in generations], [g.token_ids for g in generations]
    with torch.no_grad():
        scored = policy.score(prompts, responses, temperature=0.7)
        assert scored.entropies is not None
        for prompt, response, logp, entropy in zip(prompts, responses, scored.logprobs, scored.entropies,
                                                   strict=True):
            ids = torch.tensor([list(prompt) + list(response)])
            logits = policy.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / 0.7  # (R, V)
            expected = torch.distributions.Categorical(logits=logits).entropy()
            torch.testing.assert_close(entropy, expected, atol=1e-4, rtol=0)
            torch.testing.assert_close(logp, policy.token_logprobs([prompt], [response], 0.7)[0], atol=1e-6, rtol=0)
            assert not entropy.requires_grad


def test_gradient_flows_through_token_logprobs(policy: TransformersPolicy) -> None:
    generations = policy.generate(PROMPTS, SamplingParams(max_new_tokens=6), seeds=rows(13))
    policy.model.zero_grad(set_to_none=True)
    logps = _batch_logprobs(policy, generations, 1.0)
    assert all(lp.requires_grad for lp in logps)
    torch.stack([lp.sum() for lp in logps]).sum().backward()
    try:
        for name, parameter in policy.model.named_parameters():
            assert parameter.grad is not None, name
            assert parameter.grad.abs().sum() > 0, name
    finally:
        policy.model.zero_grad(set_to_none=True)


def test_token_logprobs_checks_its_inputs(policy: TransformersPolicy) -> None:
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        policy.token_logprobs([[5], [6]], [[7]])
    with pytest.raises(ValueError, match="temperature"):
        policy.token_logprobs([[5]], [[7]], temperature=-1.0)


# -- architectures ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("architecture", "class_name"), [("qwen2", "Qwen2ForCausalLM"), ("llama", "LlamaForCausalLM")])
def test_both_architectures_build_generate_and_rescore(corpus: list[str], architecture: str, class_name: str) -> None:
    settings = SMALL.model_copy(update={"architecture": architecture})
    built = build_tiny(settings, corpus=corpus)
    assert type(built.model).__name__ == class_name
    assert weight_hash(build_tiny(settings, corpus=corpus).model) == weight_hash(built.model)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.8)
    generations = built.generate(PROMPTS, sampling, seeds=rows(1))
    assert built.generate(PROMPTS, sampling, seeds=rows(1)) == generations
    assert all(len(g.token_ids) >= 1 for g in generations)
    with torch.no_grad():
        for generation, logps in zip(generations, _batch_logprobs(built, generations, 0.8), strict=True):
            torch.testing.assert_close(logps, torch.tensor(generation.logprobs), atol=1e-4, rtol=0)


def test_llama_and_qwen2_presets_differ(corpus: list[str], policy: TransformersPolicy) -> None:
    llama = build_tiny(SMALL.model_copy(update={"architecture": "llama"}), corpus=corpus)
    assert weight_hash(llama.model) != weight_hash(policy.model)


# -- the vLLM adapter ---------------------------------------------------------------------------------------------


def test_vllm_policy_without_vllm_names_the_gpu_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.models.vllm_backend import VllmPolicy

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError, installed or not
    with pytest.raises(ConfigError, match=r"gpu.*pip install 'complementary-rl\[gpu\]'") as caught:
        VllmPolicy("/nonexistent")
    assert isinstance(caught.value.__cause__, ImportError)


def test_another_process_builds_the_same_preset_without_importing_vllm(policy: TransformersPolicy) -> None:
    # A fresh interpreter has other hash seeds (Python and the Rust BPE trainer) and its own RNG state.
    import subprocess

    code = (
        "import sys, pipeline.models as m\n"
        f"p = m.build_tiny(m.TinyModelSettings.model_validate({SMALL.model_dump()!r}))\n"
        "print(m.weight_hash(p.model), p.tokenizer.backend_tokenizer.to_str() == sys.stdin.read(),"
        " 'pipeline.models.vllm_backend' in sys.modules, 'vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], input=policy.tokenizer.backend_tokenizer.to_str(),
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == [weight_hash(policy.model), "True", "False", "False"]


def test_vllm_policy_samples_reproducibly_with_the_transformers_logprob_semantics(policy, tmp_path) -> None:
    pytest.importorskip("vllm", reason="vllm is the optional 'gpu' extra (CUDA only); it is not installed here")
    if not torch.cuda.is_available():
        pytest.skip("vllm needs a CUDA device")
    from pipeline.models.checkpoints import save_checkpoint
    from pipeline.models.vllm_backend import VllmPolicy

    info = save_checkpoint(tmp_path / "v0", policy)
    served = VllmPolicy(str(info.path), seed=0, dtype="float32", gpu_memory_utilization=0.3, max_model_len=512)
    sampling = SamplingParams(max_new_tokens=8)
    generations = served.generate(PROMPTS, sampling, seeds=rows(3))
    assert served.generate(PROMPTS, sampling, seeds=rows(3)) == generations
    with torch.no_grad():
        for generation, logps in zip(generations, _batch_logprobs(policy, generations, 1.0), strict=True):
            torch.testing.assert_close(logps, torch.tensor(generation.logprobs), atol=1e-2, rtol=0)


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_model_without_a_chat_template_gets_its_plain_prompt(policy: TransformersPolicy) -> None:
    assert not policy.chat
    assert policy.prompt_ids("Action:", "You play a game.") == policy.encode("Action:")
    assert policy.response_ids("east\n") == policy.encode("east\n")


def test_a_chat_model_is_prompted_through_its_template_and_trained_to_end_its_turn(
        policy: TransformersPolicy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy.tokenizer, "chat_template", CHAT_TEMPLATE, raising=False)
    assert policy.chat
    # Hand-worked: the template over (system, user) with the generation prompt, encoded as plain text.
    assert policy.prompt_ids("Go east.", "Be brief.") == policy.encode("<system>Be brief.\n<user>Go east.\n<assistant>")
    assert policy.prompt_ids("Go east.") == policy.encode("<user>Go east.\n<assistant>")
    assert policy.response_ids("east") == [*policy.encode("east"), policy.tokenizer.eos_token_id]
    generation = policy.generate([policy.prompt_ids("Go east.", "Be brief.")], SamplingParams(max_new_tokens=3),
                                 seeds=[0])[0]
    assert list(generation.prompt_token_ids) == policy.prompt_ids("Go east.", "Be brief.")


def test_a_generating_worker_runs_on_the_threads_it_is_given():
    from pipeline.models.base import limit_threads

    threads = torch.get_num_threads()
    try:
        limit_threads(1)
        assert torch.get_num_threads() == 1
        limit_threads(0)  # 0: leave torch's own choice
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_a_session_continues_from_its_kept_prefix_and_samples_what_a_fresh_prompt_would(
        policy: TransformersPolicy) -> None:
    sampling = SamplingParams(max_new_tokens=8)
    first_turn = [p + " north" for p in PROMPTS]
    second_turn = [p + " north\nObservation: a wall\nAction:" for p in PROMPTS]
    fresh = TransformersPolicy(policy.model, policy.tokenizer)
    expected = fresh.generate(second_turn, sampling, seeds=rows(4, len(second_turn)))
    kept = TransformersPolicy(policy.model, policy.tokenizer)
    sessions = ["e0", "e1", None, "e3"]  # row 2 plays without a session
    kept.generate(first_turn, sampling, seeds=rows(3, len(first_turn)), sessions=sessions)
    assert sorted(kept._sessions) == ["e0", "e1", "e3"]
    first_lengths = [len(policy.encode(first_turn[i])) for i in (0, 1, 3)]
    assert [len(k.prompt_ids) for k in kept._sessions.values()] == first_lengths
    # The second turn runs only what each prompt adds (at least its last token) on the kept keys and values.
    before = kept.prompt_tokens_run
    continued = kept.generate(second_turn, sampling, seeds=rows(4, len(second_turn)), sessions=sessions)
    assert kept.prompt_tokens_reused == sum(first_lengths)
    assert kept.prompt_tokens_run - before == sum(len(policy.encode(p)) for p in second_turn) - sum(first_lengths)
    assert [g.token_ids for g in continued] == [g.token_ids for g in expected]
    for ours, theirs in zip(continued, expected, strict=True):
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=1e-5, rtol=0)
        assert ours.prompt_token_ids == theirs.prompt_token_ids
    # A prompt that departs from its session's early on, and one equal to it, still match a fresh run.
    changed = ["Action:", second_turn[1], "x", second_turn[3]]
    assert ([g.token_ids for g in kept.generate(changed, sampling, seeds=rows(5, len(changed)), sessions=sessions)]
            == [g.token_ids for g in fresh.generate(changed, sampling, seeds=rows(5, len(changed)))])
    kept.end_sessions(["e0"])
    assert sorted(kept._sessions) == ["e1", "e3"]
    kept.end_sessions()
    assert not kept._sessions
    kept.max_sessions = 2
    kept.generate(PROMPTS, sampling, seeds=rows(1), sessions=["a", "b", "c", "d"])
    assert list(kept._sessions) == ["c", "d"]  # the least recently used went first
    with pytest.raises(InvalidArgumentError, match="4 prompts but 3 sessions"):
        kept.generate(PROMPTS, sampling, seeds=rows(1), sessions=["a", "b", "c"])
