"""How long a group member holding nothing waits before each recreation of its consumer (`recreate_after`): the
first wait is `stuck_after_s`, every recreation in a row doubles it up to `longest_wait_s`, and a random part of up
to `jitter` of the wait is added, so two members left with nothing by one slow rebalance fall out of step instead of
restarting each other's rebalance for ever."""

from __future__ import annotations

from typing import NoReturn

import pytest

from pipeline.runtime.transport import GroupWatch, recreate_after


def _watch() -> GroupWatch:
    def unused() -> NoReturn:
        raise AssertionError("the schedule never calls the broker")

    return GroupWatch(new_consumer=unused, unowned=unused, stuck_after_s=30.0, longest_wait_s=240.0, jitter=0.5)


@pytest.mark.parametrize(("recreations", "draw", "wait"), [
    (0, 0.0, 30.0),    # the first wait is exact
    (0, 0.9, 30.0),    # ... whatever the draw
    (1, 0.0, 60.0),    # 30 * 2
    (1, 0.5, 75.0),    # 60 * (1 + 0.5 * 0.5)
    (2, 0.0, 120.0),   # 30 * 4
    (3, 0.0, 240.0),   # 30 * 8 = the longest wait
    (4, 0.0, 240.0),   # 30 * 16, held at 240
    (4, 1.0, 360.0),   # 240 * (1 + 0.5): the bound no draw in [0, 1) reaches
])
def test_each_recreation_in_a_row_doubles_the_wait_up_to_the_longest_plus_its_random_part(recreations, draw, wait):
    assert recreate_after(_watch(), recreations, draw) == pytest.approx(wait)


def test_two_members_that_recreated_together_are_apart_by_the_difference_of_their_draws():
    watch = _watch()
    assert recreate_after(watch, 2, 0.9) - recreate_after(watch, 2, 0.1) == pytest.approx(120 * 0.5 * 0.8)
