"""What protects a rank's state against its loss: snapshots, host copies, a standby's holding, checkpoints."""
