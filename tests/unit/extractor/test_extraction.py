"""The extractor's prompt, its strict answer parser, ids, and the rule-based summariser of the warm start."""

from __future__ import annotations

import pytest

from pipeline.envs.settings import EnvSettings, TaskMix
from pipeline.extractor.protocol import (
    DistillOp,
    MergeOp,
    ParseError,
    TrajectoryDigest,
    capacity_evictions,
    distill_generation_id,
    distill_prompt,
    merge_prompt,
    new_experience_id,
    op_id,
    parse_distill,
    parse_merge,
    render_answer,
)
from pipeline.extractor.settings import ExtractorSettings
from pipeline.rl.warm_data import (
    extractor_samples,
    lesson,
    play_data_episodes,
    summarise,
    summarise_merge,
)

DIGEST = TrajectoryDigest(env_id="MiniHack-Room-Random-5x5-v0", task_family="minihack-room",
                          goal="reach the staircase down (>)", first_observation="Map:\n.@.>",
                          actions=("east", "(invalid)", "east"), success=True, truncated=False)


def _parse(response: str, shown: int = 1) -> list[DistillOp]:
    return parse_distill(response, shown, max_ops=3, max_chars=50)


def test_the_distill_prompt_lists_actions_outcome_and_the_experiences_by_alias():
    prompt = distill_prompt(DIGEST, ["Go east.", "Avoid walls."], max_ops=3, max_actions=2)
    assert prompt == (
        "Task: MiniHack-Room-Random-5x5-v0. Goal: reach the staircase down (>)\n"
        "Start:\nMap:\n.@.>\n"
        "Actions: east, (invalid), ... (1 more)\n"
        "Outcome: SUCCESS after 3 actions (1 invalid)\n"
        "Experiences shown:\n[1] Go east.\n[2] Avoid walls.\n"
        "Lessons as ops, at most 3, in <answer>[...]</answer>:"
    )
    assert "Experiences shown: none" in distill_prompt(DIGEST, [], max_ops=3, max_actions=9)
    revealed = TrajectoryDigest(**{**DIGEST.__dict__, "revealed": ("staircase down: 2 east of the start",
                                                                   "key: 1 north of the start")})
    assert "Outcome: SUCCESS after 3 actions (1 invalid)\n" \
        "Revealed: staircase down: 2 east of the start; key: 1 north of the start\nExperiences shown: none" \
        in distill_prompt(revealed, [], max_ops=3, max_actions=9)
    assert merge_prompt("sokoban", ["a", "b"]) == (
        "Experiences of sokoban:\n[1] a\n[2] b\n"
        "Consolidate as ops (keep, merge, rewrite, discard) in <answer>[...]</answer>:")


def test_a_valid_answer_parses_with_reasoning_before_it_and_whitespace_normalised():
    response = 'Short path. <answer>[{"op": "add", "text": "Go  east\\nfirst."}, ' \
               '{"op": "refine", "id": 1, "text": "Walls block."}]</answer>'
    assert _parse(response) == [DistillOp("add", "Go east first."), DistillOp("refine", "Walls block.", 1)]
    assert _parse("<answer>[]</answer>") == []
    # generation stops at the closing tag; a backend that drops it still gives a parseable answer
    assert _parse('<answer>[{"op": "add", "text": "x"}]') == [DistillOp("add", "x")]


@pytest.mark.parametrize(("response", "reason"), [
    ("no answer at all", "exactly one <answer>"),
    ("<answer>[]</answer><answer>[]</answer>", "found 2"),
    ("<answer>[{op: add}]</answer>", "not JSON"),
    ('<answer>{"op": "add", "text": "x"}</answer>', "must be a JSON list"),
    ('<answer>[{"op": "add", "text": "a"}, {"op": "add", "text": "b"}, {"op": "add", "text": "c"}, '
     '{"op": "add", "text": "d"}]</answer>', "4 ops; at most 3"),
    ('<answer>[{"op": "delete", "id": 1}]</answer>', "unknown op 'delete'"),
    ('<answer>[{"op": "add", "text": "x", "id": 1}]</answer>', "exactly the keys"),
    ('<answer>[{"op": "refine", "id": 2, "text": "x"}]</answer>', "id 2 is not one of the experiences shown (1..1)"),
    ('<answer>[{"op": "refine", "id": true, "text": "x"}]</answer>', "is not one of"),
    ('<answer>[{"op": "refine", "id": 1, "text": "x"}, {"op": "refine", "id": 1, "text": "y"}]</answer>',
     "refined twice"),
    ('<answer>[{"op": "add", "text": "  "}]</answer>', "non-empty text"),
    ('<answer>[{"op": "add", "text": "' + "x" * 51 + '"}]</answer>', "51 characters exceeds the limit of 50"),
    ('<answer>["add"]</answer>', "must be a JSON object"),
])
def test_anything_else_is_a_parse_error_with_its_reason(response, reason):
    with pytest.raises(ParseError, match=reason.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        _parse(response)


def test_a_refine_when_nothing_was_shown_is_an_error_not_an_add():
    with pytest.raises(ParseError, match="none was shown"):
        _parse('<answer>[{"op": "refine", "id": 1, "text": "x"}]</answer>', shown=0)


def test_merge_answers_name_each_entry_at_most_once():
    response = ('<answer>[{"op": "merge", "ids": [1, 3], "text": "both"}, {"op": "discard", "id": 2}, '
                '{"op": "keep", "id": 4}, {"op": "rewrite", "id": 5, "text": "new"}]</answer>')
    assert parse_merge(response, 5, max_chars=50) == [
        MergeOp("merge", (1, 3), "both"), MergeOp("discard", (2,)), MergeOp("keep", (4,)),
        MergeOp("rewrite", (5,), "new")]
    with pytest.raises(ParseError, match="at least two ids"):
        parse_merge('<answer>[{"op": "merge", "ids": [1], "text": "x"}]</answer>', 2, max_chars=50)
    with pytest.raises(ParseError, match="named by more than one op"):
        parse_merge('<answer>[{"op": "merge", "ids": [1, 2], "text": "x"}, {"op": "discard", "id": 2}]</answer>',
                    2, max_chars=50)
    with pytest.raises(ParseError, match="id 3 is not one of"):
        parse_merge('<answer>[{"op": "discard", "id": 3}]</answer>', 2, max_chars=50)


def test_ids_are_deterministic_functions_of_the_run_and_the_trajectory():
    generation = distill_generation_id("run-a", "s000002-g001-k0")
    assert generation == "run-a-s000002-g001-k0"
    assert op_id(generation, 1) == "run-a-s000002-g001-k0-op1"
    assert new_experience_id(generation, 0) == "run-a-s000002-g001-k0-e0"


def test_the_rule_based_summariser_writes_answers_the_parser_accepts():
    assert lesson(DIGEST, 400) == "Solved in 3 actions. Start with east and keep heading for the goal."
    failed = TrajectoryDigest(**{**DIGEST.__dict__, "success": False,
                                 "actions": ("west", "west", "(invalid)", "north")})
    assert lesson(failed, 400) == ("Failed after 4 actions (1 invalid). Do not repeat west; use listed actions and"
                                   " head for the goal.")
    added = parse_distill(summarise(DIGEST, [], 400), 0, max_ops=3, max_chars=400)
    assert added == [DistillOp("add", lesson(DIGEST, 400))]
    # an episode that revealed nothing leaves the lesson it was shown as it is; one that revealed something refines it
    assert parse_distill(summarise(failed, ["old"], 400), 1, max_ops=3, max_chars=400) == []
    revealing = TrajectoryDigest(**{**failed.__dict__, "revealed": ("staircase down: west of the start",)})
    refined = parse_distill(summarise(revealing, ["old"], 400), 1, max_ops=3, max_chars=400)
    assert refined == [DistillOp("refine", "Failed after 4 actions (1 invalid). staircase down: west of the start.", 1)]
    # lessons that give the same advice merge into one lesson of it; lessons that advise otherwise stay apart
    merged = parse_merge(summarise_merge(["Solved in 3 actions. Go east.", "Failed after 9 actions. Go west.",
                                          "Failed after 9 actions (1 invalid). Go east.", "Solved in 4 actions. "
                                          "Go west.", "Odd"], 400), 5, max_chars=400)
    assert merged == [MergeOp("merge", (1, 3), "2 lessons agree: Go east."),
                      MergeOp("merge", (2, 4), "2 lessons agree: Go west.")]
    assert render_answer([]) == "<answer>[]</answer>"
    # what the episode revealed replaces the generic advice
    found = TrajectoryDigest(**{**DIGEST.__dict__, "revealed": ("staircase down: 1 north, 2 west of the start",)})
    assert lesson(found, 400) == "Solved in 3 actions. staircase down: 1 north, 2 west of the start."
    lost = TrajectoryDigest(**{**failed.__dict__, "revealed": ("key: 3 south of the start",)})
    assert lesson(lost, 400) == "Failed after 4 actions (1 invalid). key: 3 south of the start."


def test_data_episodes_and_samples_are_deterministic_and_labelled_by_the_solver():
    tasks = [TaskMix(env_id="MiniHack-Room-Random-5x5-v0", max_turns=10)]
    first = play_data_episodes(tasks, EnvSettings(), 6, 1.0, seed=3)
    assert first == play_data_episodes(tasks, EnvSettings(), 6, 1.0, seed=3)
    assert all(e.digest.success for e in first), "the scripted Room solver solves every empty room"
    assert all(turn.label is not None for e in first for turn in e.turns)
    assert all(e.digest.revealed and e.digest.revealed[0].startswith("staircase down: ") for e in first), \
        "a lit room shows its stairs from the start"
    samples = extractor_samples(first, ExtractorSettings(), seed=3)
    assert len(samples) == 6 + 6 // 4
    for prompt, answer in samples[:6]:
        shown = 1 if "Experiences shown:\n[1]" in prompt else 0
        assert parse_distill(answer, shown, max_ops=3, max_chars=400)


def test_capacity_evicts_the_oldest_beyond_the_cap_counting_pending_adds():
    oldest_first = ["e1", "e2", "e3", "e4"]
    assert capacity_evictions(oldest_first, pending_adds=0, capacity=4) == []
    assert capacity_evictions(oldest_first, pending_adds=2, capacity=4) == ["e1", "e2"]
    assert capacity_evictions(oldest_first, pending_adds=0, capacity=1) == ["e1", "e2", "e3"]
    assert capacity_evictions([], pending_adds=5, capacity=3) == []  # what is not applied yet cannot be retired


def test_the_actors_data_carries_informative_and_irrelevant_experiences():
    from pipeline.rl.warm_data import actor_samples as warm_actor_samples

    tasks = [TaskMix(env_id="MiniHack-Room-Random-5x5-v0", max_turns=10)]
    episodes = play_data_episodes(tasks, EnvSettings(), 40, 1.0, seed=5)
    samples = warm_actor_samples(episodes, history_turns=2, seed=5)
    turns = [(e, t) for e in episodes for t in e.turns if t.label is not None]
    assert len(samples) == len(turns)
    kinds = {"none": 0, "its own task's": 0, "another task's": 0}
    for (prompt, label), (episode, turn) in zip(samples, turns, strict=True):
        assert label == f" {turn.label}\n"
        line = next((x for x in prompt.splitlines() if x.startswith("Experience: ")), None)
        if line is None:
            kinds["none"] += 1
        else:  # each room is its own task here: the informative lesson is the one its episode revealed
            kinds["its own task's" if line == f"Experience: {lesson(episode.digest, 400)}" else "another task's"] += 1
    total = sum(kinds.values())
    assert all(0.23 < count / total < 0.43 for count in kinds.values()), kinds  # a third each


def test_on_a_memory_task_lessons_that_state_the_side_are_followed_and_the_rest_leave_the_actor_guessing():
    from pipeline.rl.warm_data import actor_samples as warm_actor_samples

    tasks = [TaskMix(env_id="MiniHack-DarkCorridor-v0", max_turns=9)]
    episodes = play_data_episodes(tasks, EnvSettings(), 64, 0.5, seed=2, plays_per_task=4)
    goals = [e.digest.goal for e in episodes]
    assert len(set(goals)) <= 16 and max(goals.count(g) for g in goals) >= 3, "16 tasks, each played several times"
    facts = {e.digest.goal: set() for e in episodes}
    for e in episodes:
        if e.digest.revealed:
            facts[e.digest.goal].add(lesson(e.digest, 400))
    turns = [(e, t) for e in episodes for t in e.turns if t.label is not None]
    samples = warm_actor_samples(episodes, history_turns=2, seed=2)
    assert len(samples) == len(turns)
    kinds = {"informative": 0, "irrelevant": 0, "none": 0}
    for (prompt, label), (episode, turn) in zip(samples, turns, strict=True):
        line = next((x for x in prompt.splitlines() if x.startswith("Experience: ")), None)
        if line is None:
            kinds["none"] += 1
            assert label.strip() in turn.uninformed
        elif "staircase down" in line:  # states the side: always of this very corridor, and the label follows it
            kinds["informative"] += 1
            assert line.removeprefix("Experience: ") in facts[episode.digest.goal]
            assert label == f" {turn.label}\n" and f"{turn.label} of the start" in line
        else:  # a lesson that states nothing: the actor guesses as without one
            kinds["irrelevant"] += 1
            assert label.strip() in turn.uninformed
    assert all(count / len(samples) > 0.2 for count in kinds.values()), kinds
    # with label noise, that share of labels is any available action instead
    noisy = warm_actor_samples(episodes, history_turns=2, seed=2, label_noise=0.5)
    off_axis = sum(label.strip() not in ("east", "west") for _, label in noisy) / len(noisy)
    assert 0.3 < off_axis < 0.45, off_axis  # half redrawn among 8 directions, 6 of which leave the corridor's axis
