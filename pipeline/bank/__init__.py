"""The experience bank: a deterministic projection of crl.experience-ops (state machine, index, store)."""
