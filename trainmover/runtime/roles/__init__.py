"""A rank's roles: a standby, the training loop, a planned migration's switch, recovery after a
failure, and the mechanisms only they use (the step boundary's vote, an epoch's keys, the groups a
one-node standby builds ahead)."""
