"""The actor's side of the loop: the episode player a rollout worker wraps (`episodes`), and the success / action
metrics of finished episodes (`metrics`)."""
