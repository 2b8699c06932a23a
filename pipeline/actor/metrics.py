"""Rollout metrics from finished episodes: success rate, action efficiency and invalid-action rate, overall, per
environment and per subgroup (guided / free). The scheduler logs them per step and puts the run's totals in
`RunFinished`; rollout workers log them as they go; the report reads them back.

    episode_metrics(trajectories, "rollout")["rollout/MiniHack-Room-Random-5x5-v0/guided/success"]

For every scope: `episodes`, `success` (fraction solved), `actions_per_solved` (mean actions of the solved ones —
the paper's action efficiency; absent when none was solved) and `invalid_rate` (invalid actions over actions).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from schemas.trajectories import TrajectoryCompleted


def episode_metrics(trajectories: Iterable[TrajectoryCompleted], prefix: str) -> dict[str, float]:
    scopes: dict[str, list[TrajectoryCompleted]] = defaultdict(list)
    for trajectory in trajectories:
        subgroup = "guided" if trajectory.guided else "free"
        for scope in ("all", subgroup, trajectory.env_id, f"{trajectory.env_id}/{subgroup}"):
            scopes[scope].append(trajectory)
    metrics: dict[str, float] = {}
    for scope, members in sorted(scopes.items()):
        solved = [t for t in members if t.success]
        actions = sum(t.num_actions for t in members)
        metrics[f"{prefix}/{scope}/episodes"] = float(len(members))
        metrics[f"{prefix}/{scope}/success"] = len(solved) / len(members)
        if solved:
            metrics[f"{prefix}/{scope}/actions_per_solved"] = sum(t.num_actions for t in solved) / len(solved)
        invalid = sum(t.invalid_actions for t in members)
        metrics[f"{prefix}/{scope}/invalid_rate"] = invalid / actions if actions else 0.0
    return metrics


def summary_line(metrics: dict[str, float], prefix: str) -> str:
    """`success 0.62 (guided 0.70, free 0.55), 9.1 actions per solved, 12% invalid` for a log line."""
    def get(scope: str, name: str) -> float | None:
        return metrics.get(f"{prefix}/{scope}/{name}")

    parts = [f"success {get('all', 'success') or 0.0:.2f}"]
    subgroups = [f"{s} {get(s, 'success'):.2f}" for s in ("guided", "free") if get(s, "success") is not None]
    if subgroups:
        parts[0] += f" ({', '.join(subgroups)})"
    if (actions := get("all", "actions_per_solved")) is not None:
        parts.append(f"{actions:.1f} actions per solved")
    parts.append(f"{100 * (get('all', 'invalid_rate') or 0.0):.0f}% invalid")
    return ", ".join(parts)
