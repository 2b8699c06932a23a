"""The RL maths: advantages and policy losses as small pure torch functions (`advantages.py`, `losses.py`), and one
optimiser step over a batch of samples that both trainers and `crl replay train` share (`policy_step.py`)."""
