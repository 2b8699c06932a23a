"""Warm-start data on a family with a rule across tasks (signpost corridors, the real engine): the three kinds of
lesson, the extractor's mix of them, the actor's lessons that point either way, and the lesson classifier."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from pipeline.envs.settings import EnvSettings, SignpostSettings, TaskMix
from pipeline.envs.signpost_corridor import SIGNPOST_RULE, lesson_kind, revealed_for
from pipeline.extractor.protocol import TrajectoryDigest, parse_distill
from pipeline.extractor.settings import ExtractorSettings
from pipeline.rl.warm_data import actor_samples, extractor_samples, lesson, lesson_kinds, play_data_episodes

TASKS = [TaskMix(env_id="MiniHack-SignpostCorridor-v0", max_turns=9)]
FIRST = "Map:\n---\n_@{\n---\nBy the start: altar west, fountain east\nLegend: ..."
DIGEST = TrajectoryDigest(env_id="MiniHack-SignpostCorridor-v0", task_family="minihack-signpost-corridor",
                          goal="reach the staircase down (>) of the pale newt corridor", first_observation=FIRST,
                          actions=("west",) * 3, success=True, truncated=False,
                          revealed=("staircase down: 3 west of the start", "on the staircase's side: altar"))


def test_a_lesson_of_each_kind_and_what_the_classifier_reads_back():
    assert lesson(DIGEST, 400) == "Solved in 3 actions. the staircase down is on the altar's side."
    assert lesson(DIGEST, 400, kind="instance") == "Solved in 3 actions. staircase down: 3 west of the start."
    assert lesson(DIGEST, 400, kind="over-general") == \
        "Solved in 3 actions. the staircase down is always west of the start."
    kinds = [lesson_kind(lesson(DIGEST, 400, kind=k), "altar") for k in ("rule", "instance", "over-general")]
    assert kinds == ["rule", "instance", "over-general"]
    assert lesson_kind(lesson(DIGEST, 400), "sink") == "wrong rule" and lesson_kind("Solved in 3 actions.", "x") is None
    assert lesson_kind("the staircase down is on the grave's side", None) == "wrong rule", "no rule per task"
    with pytest.raises(ValueError, match="unknown lesson kind 'vague'"):
        SIGNPOST_RULE.statement(DIGEST.revealed, "vague")
    # what the same corridor would reveal with its stairs the other way: the furnishing standing there
    assert revealed_for(FIRST, "east", 5) == ("staircase down: 5 east of the start",
                                              "on the staircase's side: fountain")
    with pytest.raises(ValueError, match="no one furnishing stands north"):
        revealed_for(FIRST, "north", 2)


def test_the_extractors_data_writes_the_rule_in_its_share_and_the_wrong_kinds_half_each_of_the_rest():
    episodes = play_data_episodes(TASKS, EnvSettings(), 96, 0.5, seed=4, plays_per_task=4)
    revealing = [e for e in episodes if e.digest.revealed]
    assert len(revealing) > 40
    furnishings = {re.search(r"side: (\w+)", e.digest.revealed[1]).group(1) for e in revealing}
    assert len(furnishings) == 4, "the data plays a signpost per corridor, so every kind is copied"
    kinds = lesson_kinds(episodes, 1 / 3, seed=4)
    assert [k is None for k in kinds] == [not e.digest.revealed for e in episodes]
    counts = Counter(k for k in kinds if k is not None)
    assert all(0.2 < counts[k] / len(revealing) < 0.47 for k in ("rule", "instance", "over-general")), counts
    samples = extractor_samples(episodes, ExtractorSettings(), seed=4, merges=False, rule_share=1 / 3)
    perfect = extractor_samples(episodes, ExtractorSettings(), seed=4, merges=False)
    written = Counter()
    for (prompt, answer), (same_prompt, _), episode, kind in zip(samples, perfect, episodes, kinds, strict=True):
        ops = parse_distill(answer, 1 if "Experiences shown:\n[1]" in prompt else 0, max_ops=3, max_chars=400)
        if "Experiences shown:\n[1]" not in prompt:
            assert same_prompt == prompt, "the kinds are drawn apart: a prompt showing nothing is the same"
        if kind is None or not ops:
            continue
        signpost = re.search(r"side: (\w+)", episode.digest.revealed[1]).group(1)
        assert lesson_kind(ops[0].text, signpost) == kind
        written[kind] += 1
    assert set(written) == {"rule", "instance", "over-general"}
    assert all(lesson_kind(a, None) in (None, "wrong rule") for _, a in perfect), "rule_share 1: the rule alone"


def test_the_actor_learns_to_do_what_a_lesson_says_whichever_kind_and_way():
    episodes = play_data_episodes(TASKS, EnvSettings(signpost=SignpostSettings(landmark="altar")), 48, 0.5, seed=6,
                                  plays_per_task=4)
    turns = [(e, t) for e in episodes for t in e.turns if t.label is not None]
    samples = actor_samples(episodes, history_turns=2, seed=6)
    assert len(samples) == len(turns)
    seen = Counter()
    for (prompt, label), (_episode, turn) in zip(samples, turns, strict=True):
        line = next((x for x in prompt.splitlines() if x.startswith("Experience: ")), None)
        where = next(x for x in prompt.splitlines() if x.startswith("By the start: "))
        kind = lesson_kind(line, None) if line else None
        if line is None or kind is None:
            assert label.strip() in turn.uninformed, "without a lesson that points, the actor guesses"
            seen["none"] += 1
            continue
        if kind == "wrong rule":  # a rule names a furnishing of this corridor: the label names it too
            named = re.search(r"on the (\w+)'s side", line).group(1)
            assert label == f" {named}\n", (line, where)
            side = re.search(rf"{named} (east|west)", where).group(1)
        else:
            side = re.search(r'(east|west) of the start', line).group(1)
            assert label == f" {side}\n"
        seen[(kind, side)] += 1
    for kind in ("wrong rule", "instance", "over-general"):  # each kind points both ways
        assert seen[(kind, "east")] > 5 and seen[(kind, "west")] > 5, seen
