"""Moving a rank's state to the rank that takes its slot: the verified stream and its plan."""
