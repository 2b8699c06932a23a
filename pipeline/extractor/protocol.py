"""What the extractor reads and writes, without Kafka or a model: prompts, the strict answer parser, and the ids of
what it publishes (`pipeline.extractor.ops` turns parsed answers into those events). The extractor worker
(`workers/extractor.py`) and the warm start (`pipeline/rl/warm_start.py`) both build on it, so the tiny preset learns
exactly the format the worker parses.

Distillation. The prompt holds the goal, the trajectory (its first observation, the actions with invalid ones marked,
never the experience that was injected), the outcome, what the episode revealed (where the environment states it: a
landmark's place relative to the start), and the experiences that were shown by alias:

    Task: MiniHack-Room-Random-5x5-v0. Goal: reach the staircase down (>)
    Start:
    <first observation>
    Actions: east, southeast, (invalid), south
    Outcome: SUCCESS after 4 actions (1 invalid)
    Revealed: staircase down: 1 north, 2 west of the start
    Experiences shown:
    [1] Walk toward the > ...
    Lessons as ops, at most 3, in <answer>[...]</answer>:

and the answer is a short reasoning (optional) followed by exactly one `<answer>` holding a JSON list of at most
`max_ops` ops: `{"op": "add", "text": ...}` or `{"op": "refine", "id": <alias>, "text": ...}`; `[]` keeps nothing.
Anything else — no or several answers, bad JSON, unknown keys, an alias that was not shown, two refines of one alias,
an empty or over-long text — is a `ParseError` with its reason, recorded as `parse_error`: never a silent add.

Merging. Per task family, the active experiences in log order are shown in chunks of `merge_chunk` (aliases
1..n) and the answer lists `keep`, `merge` (2+ ids, new text), `rewrite` (one id, new text) or `discard` ops; an
experience not named is kept. The newest experience a chunk produced (merged or rewritten) slides into the next
chunk as its first entry, so consolidation carries across the whole family.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pipeline.errors import ParseError
from pipeline.models.base import stream_seed
from schemas.trajectories import TrajectoryCompleted

T = TypeVar("T")
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
ANSWER_STOP = "</answer>"
EXTRACTOR_SYSTEM = ("You keep a bank of short, reusable lessons about a text game. Answer with an optional short "
                    "reasoning, then exactly one <answer>[...]</answer> holding a JSON list of ops.")
"""The system message a chat model is prompted with (`PolicyModel.prompt_ids`); the tiny preset gets the prompt
alone."""
DISTILL_INSTRUCTION = "Lessons as ops, at most {max_ops}, in <answer>[...]</answer>:"
MERGE_INSTRUCTION = "Consolidate as ops (keep, merge, rewrite, discard) in <answer>[...]</answer>:"


@dataclass(frozen=True)
class TrajectoryDigest:
    """What the extractor is shown of an episode (the injected experience is never part of it)."""

    env_id: str
    task_family: str
    goal: str
    first_observation: str
    actions: tuple[str, ...]
    """Actions in order; an invalid one is recorded as `(invalid)`."""
    success: bool
    truncated: bool
    revealed: tuple[str, ...] = ()
    """What the episode uncovered, as the environment states it (`TrajectoryCompleted.revealed`)."""

    @property
    def invalid(self) -> int:
        return sum(action == INVALID for action in self.actions)

    @classmethod
    def of(cls, trajectory: TrajectoryCompleted) -> TrajectoryDigest:
        return cls(
            env_id=trajectory.env_id, task_family=trajectory.task_family, goal=trajectory.goal,
            first_observation=trajectory.turns[0].observation if trajectory.turns else "",
            actions=tuple(turn.action if turn.valid else INVALID for turn in trajectory.turns),
            success=trajectory.success, truncated=trajectory.truncated, revealed=trajectory.revealed,
        )


INVALID = "(invalid)"


def distill_prompt(digest: TrajectoryDigest, shown: Sequence[str], *, max_ops: int, max_actions: int) -> str:
    """The distillation prompt; `shown[i]` is the text of alias i + 1."""
    actions = list(digest.actions[:max_actions])
    if len(digest.actions) > max_actions:
        actions.append(f"... ({len(digest.actions) - max_actions} more)")
    outcome = "SUCCESS" if digest.success else "FAILURE"
    lines = [
        f"Task: {digest.env_id}. Goal: {digest.goal}",
        "Start:",
        digest.first_observation,
        "Actions: " + (", ".join(actions) if actions else "none"),
        f"Outcome: {outcome} after {len(digest.actions)} actions ({digest.invalid} invalid)"
        + (", turn limit reached" if digest.truncated else ""),
    ]
    if digest.revealed:
        lines.append("Revealed: " + "; ".join(digest.revealed))
    if shown:
        lines.append("Experiences shown:")
        lines += [f"[{alias}] {text}" for alias, text in enumerate(shown, start=1)]
    else:
        lines.append("Experiences shown: none")
    lines.append(DISTILL_INSTRUCTION.format(max_ops=max_ops))
    return "\n".join(lines)


def merge_prompt(task_family: str, entries: Sequence[str]) -> str:
    """The merge prompt for one chunk; `entries[i]` is the text of alias i + 1."""
    lines = [f"Experiences of {task_family}:"]
    lines += [f"[{alias}] {text}" for alias, text in enumerate(entries, start=1)]
    lines.append(MERGE_INSTRUCTION)
    return "\n".join(lines)


# -- parsing --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistillOp:
    op: Literal["add", "refine"]
    text: str
    alias: int | None = None
    """The shown experience a refine rewrites (1-based); None for add."""


@dataclass(frozen=True)
class MergeOp:
    op: Literal["keep", "merge", "rewrite", "discard"]
    aliases: tuple[int, ...]
    text: str | None = None


def _answer_list(response: str) -> list[object]:
    answers = ANSWER.findall(response)
    if not answers and "<answer>" in response and ANSWER_STOP not in response:
        # Generation stops at the closing tag, and backends may or may not keep it: accept a final open answer.
        answers = [response.split("<answer>", 1)[1]] if response.count("<answer>") == 1 else []
    if len(answers) != 1:
        raise ParseError(f"expected exactly one <answer>...</answer>, found {len(answers)}")
    try:
        value = json.loads(answers[0])
    except json.JSONDecodeError as exc:
        raise ParseError(f"the answer is not JSON: {exc.msg} at position {exc.pos}") from exc
    if not isinstance(value, list):
        raise ParseError(f"the answer must be a JSON list of ops, got {type(value).__name__}")
    return value


def _text(item: dict[str, Any], max_chars: int) -> str:
    text = item.get("text")
    if not isinstance(text, str) or not text.strip():
        raise ParseError(f"op {item.get('op')!r} needs a non-empty text")
    text = " ".join(text.split())
    if len(text) > max_chars:
        raise ParseError(f"text of {len(text)} characters exceeds the limit of {max_chars}")
    return text


def _alias(value: object, shown: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= shown:
        raise ParseError(f"id {value!r} is not one of the experiences shown (1..{shown})" if shown
                         else f"id {value!r} refers to an experience, but none was shown")
    return value


def _keys(item: object, allowed: dict[str, set[str]]) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise ParseError(f"every op must be a JSON object, got {type(item).__name__}")
    op = item.get("op")
    if op not in allowed:
        raise ParseError(f"unknown op {op!r}; valid ops: {', '.join(allowed)}")
    if set(item) != allowed[op]:
        raise ParseError(f"op {op!r} takes exactly the keys {sorted(allowed[op])}, got {sorted(item)}")
    return item


_DISTILL_KEYS = {"add": {"op", "text"}, "refine": {"op", "id", "text"}}
_MERGE_KEYS = {"keep": {"op", "id"}, "merge": {"op", "ids", "text"}, "rewrite": {"op", "id", "text"},
               "discard": {"op", "id"}}


def parse_distill(response: str, shown: int, *, max_ops: int, max_chars: int) -> list[DistillOp]:
    """The ops of a distillation answer (`[]`: keep nothing), or `ParseError`."""
    items = _answer_list(response)
    if len(items) > max_ops:
        raise ParseError(f"{len(items)} ops; at most {max_ops} are allowed")
    ops = []
    for item in items:
        item = _keys(item, _DISTILL_KEYS)
        if item["op"] == "add":
            ops.append(DistillOp("add", _text(item, max_chars)))
        else:
            ops.append(DistillOp("refine", _text(item, max_chars), _alias(item["id"], shown)))
    refined = Counter(op.alias for op in ops if op.alias is not None)
    if twice := sorted(alias for alias, n in refined.items() if n > 1):
        raise ParseError(f"experience {twice[0]} is refined twice")
    return ops


def parse_merge(response: str, entries: int, *, max_chars: int) -> list[MergeOp]:
    """The ops of a merge answer (every alias at most once; unnamed entries are kept), or `ParseError`."""
    items = _answer_list(response)
    ops = []
    for item in items:
        item = _keys(item, _MERGE_KEYS)
        if item["op"] == "merge":
            ids = item["ids"]
            if not isinstance(ids, list) or len(ids) < 2:
                raise ParseError("merge needs a list of at least two ids")
            ops.append(MergeOp("merge", tuple(_alias(i, entries) for i in ids), _text(item, max_chars)))
        elif item["op"] == "rewrite":
            ops.append(MergeOp("rewrite", (_alias(item["id"], entries),), _text(item, max_chars)))
        else:
            ops.append(MergeOp(item["op"], (_alias(item["id"], entries),)))
    named = Counter(alias for op in ops for alias in op.aliases)
    if twice := sorted(alias for alias, n in named.items() if n > 1):
        raise ParseError(f"experience {twice[0]} is named by more than one op")
    return ops


def render_answer(ops: Sequence[dict[str, Any]], reasoning: str = "") -> str:
    """An answer in the format the parsers accept (what the rule-based summariser writes)."""
    body = json.dumps(list(ops), ensure_ascii=False)
    return f"{reasoning}<answer>{body}</answer>"


def capacity_evictions(active_oldest_first: Sequence[T], pending_adds: int, capacity: int) -> list[T]:
    """What FIFO eviction retires: the oldest active experiences beyond `capacity`, counting adds not yet applied."""
    excess = len(active_oldest_first) + pending_adds - capacity
    return list(active_oldest_first[:max(0, excess)])


# -- ids ------------------------------------------------------------------------------------------------------------


def distill_generation_id(run_id: str, trajectory_id: str) -> str:
    """Deterministic: a re-processed trajectory gives the same generation, op and experience ids (the bank and the
    trainer then treat the repeat as a duplicate)."""
    return f"{run_id}-{trajectory_id}"


def merge_generation_id(merge_id: str, task_family: str, chunk: int) -> str:
    return f"{merge_id}-{task_family}-c{chunk:03d}"


def distill_seed(seed: int, trajectory_id: str) -> int:
    """The row seed of the distil generation over `trajectory_id` in a run whose extractor sampling seed is `seed`
    (`extractor.generation.seed`): `stream_seed("extractor-distill", seed, trajectory_id)`. Keyed like its
    generation id (`distill_generation_id`) less the run id, which a run directory's name ties to its start time:
    the same trajectory samples the same answer in any batch, on any extractor instance, at any call."""
    return stream_seed("extractor-distill", seed, trajectory_id)


def merge_seed(seed: int, step: int, task_family: str, chunk: int) -> int:
    """The row seed of chunk `chunk` of `task_family` in the merge after step `step` (`MergeRequested.step`; the
    merge id is the run id and that step): `stream_seed("extractor-merge", seed, step, task_family, chunk)`."""
    return stream_seed("extractor-merge", seed, step, task_family, chunk)


def op_id(generation_id: str, index: int) -> str:
    return f"{generation_id}-op{index}"


def new_experience_id(generation_id: str, index: int) -> str:
    return f"{generation_id}-e{index}"


def eviction_op_id(generation_id: str, index: int) -> str:
    return f"{generation_id}-evict{index}"
