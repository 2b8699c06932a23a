"""The two small models the tests build from scratch: `TINY` where a test needs a policy to run (plumbing, seconds),
`SMALL` where it samples and checkpoints something with more than one layer."""

from __future__ import annotations

from pipeline.models import TinyModelSettings

TINY = TinyModelSettings(vocab_size=512, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                         intermediate_size=64, corpus_episodes=2)
SMALL = TinyModelSettings(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                          intermediate_size=128, corpus_episodes=8)
