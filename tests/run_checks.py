"""What a finished run's archive must show, whatever started the run (`crl run`, a cluster, the compose stack).

    with Audit(run_dir) as audit:
        assert_every_step_exactly_once(audit, steps=10, episodes_per_step=8)
"""

from __future__ import annotations

from pipeline.audit.views import Audit


def assert_every_step_exactly_once(audit: Audit, steps: int, episodes_per_step: int) -> None:
    """Every episode assigned once and played once (one trajectory each, none twice), actor versions 0 to `steps` - 1
    and trained steps 1 to `steps` - 1 without gaps or repeats, and no dead letter."""
    def rows(sql: str) -> list[tuple]:
        return audit.query(sql)[1]

    episodes = steps * episodes_per_step
    assert rows("SELECT count(*), count(DISTINCT event_id) FROM episode_assigned") == [(episodes, episodes)]
    assert rows("SELECT count(*), count(DISTINCT assignment_event_id), count(DISTINCT trajectory_id) "
                "FROM trajectory_completed") == [(episodes, episodes, episodes)]
    assert rows("SELECT list(version ORDER BY version) FROM policy_published WHERE role = 'actor'") == \
        [(list(range(steps)),)]
    assert rows("SELECT list(step ORDER BY step) FROM train_step_completed WHERE role = 'actor'") == \
        [(list(range(1, steps)),)]
    assert rows("SELECT count(*) FROM dead_letter") == [(0,)]
