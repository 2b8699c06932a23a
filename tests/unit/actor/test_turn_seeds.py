"""The seeds of per-episode and per-extraction random streams: pure functions of the run's sampling seed and the
identity of what is sampled, pinned to hand-checked BLAKE2b values."""

from __future__ import annotations

import hashlib
import uuid

from pipeline.actor.episodes import episode_id, turn_seed
from pipeline.actor.schedule import Schedule
from pipeline.actor.settings import SchedulerSettings
from pipeline.envs.settings import EnvSettings
from pipeline.extractor.protocol import distill_seed, merge_seed
from schemas.base import Producer


def _blake2b_63(encoded: bytes) -> int:
    return int(hashlib.blake2b(encoded, digest_size=8).hexdigest(), 16) >> 1


def test_turn_seed_is_the_stream_of_seed_episode_and_turn() -> None:
    # Hand-checked: blake2b-64 of the JSON parts is cca39c79e9a9c3a2, less its top bit.
    assert hashlib.blake2b(b'["actor-turn",7,"s000003-g001-k2",4]', digest_size=8).hexdigest() == "cca39c79e9a9c3a2"
    assert turn_seed(7, "s000003-g001-k2", 4) == 0xCCA39C79E9A9C3A2 >> 1 == 7372900826183164369
    assert turn_seed(0, "s000003-g001-k2", 0) == 5224164045123304455
    # Every part counts: the run's seed, the episode, the turn.
    seeds = {turn_seed(seed, f"s{step:06d}-g000-k{slot}", turn)
             for seed in range(3) for step in range(3) for slot in range(4) for turn in range(8)}
    assert len(seeds) == 3 * 3 * 4 * 8 and all(0 <= s < 2**63 for s in seeds)


def test_extraction_seeds_are_keyed_by_the_generation_not_the_run_id() -> None:
    assert distill_seed(0, "s000003-g001-k2") == _blake2b_63(b'["extractor-distill",0,"s000003-g001-k2"]') \
        == 0xD9A036EEF00DC150 >> 1 == 7840797151180808360
    assert merge_seed(0, 4, "minihack-room", 0) == _blake2b_63(b'["extractor-merge",0,4,"minihack-room",0]') \
        == 0x2AA7B2BB2A5C42A7 >> 1 == 1536810893821485395
    assert distill_seed(1, "s000003-g001-k2") != distill_seed(0, "s000003-g001-k2")
    assert len({merge_seed(0, step, family, chunk) for step in range(3) for family in ("a", "b")
                for chunk in range(3)}) == 18


def test_the_episode_id_is_the_trajectory_id_and_comes_from_the_schedule_not_the_run_id() -> None:
    schedule = Schedule(scheduler=SchedulerSettings(), envs=EnvSettings(), group_size=4, groups_per_step=2,
                        warmup_steps=0)
    who = Producer(worker="scheduler", instance="scheduler-0")
    first = schedule.train_assignments("run-20261125-235907", who, step=3)
    other_run = schedule.train_assignments("run-20261126-101010", who, step=3)
    ids = [episode_id(a) for a in first]
    assert ids == [f"s000003-g{g:03d}-k{k}" for g in range(2) for k in range(4)]
    # Another run id (a run directory's name carries its start time) changes the event ids, not the streams.
    assert [a.event_id for a in first] != [a.event_id for a in other_run]
    assert [episode_id(a) for a in other_run] == ids
    # A re-published schedule gives the same ids, so the same streams, and so does a copy with a fresh event id.
    again = schedule.train_assignments("run-20261125-235907", who, step=3)
    assert [episode_id(a) for a in again] == ids
    assert episode_id(first[0].model_copy(update={"event_id": uuid.uuid4()})) == ids[0]
