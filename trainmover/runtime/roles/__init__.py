"""A rank's roles: a standby, the training loop, a planned migration's switch and its Phase 1, recovery after a failure."""
