"""`trainmover check-workload`: would a migration of this workload be exact?

On one machine, over gloo, it does what the runtime does to a rank and compares:
  * reference ranks train without interruption (`proc.py`, role "reference");
  * joiner ranks, each a fresh process, build the workload on sandboxed groups and warm up with
    shadow steps as a standby does, receive a reference rank's state through the runtime's
    own transfer (`runtime/transfer/state.py`: encoding, checksum, in-place receive) with the
    runtime's RNG capture (`groups/rng.py`), load it and train on;
  * every step's losses and a fingerprint of the whole state are compared (`compare.py`); the
    first difference is named with the state key that differed (`fingerprint.py`).
It also checks that the state survives the transfer's encoding, and that a step repeated from
the same state (load_state_dict and RNG restore, as a rollback does) gives the same result.
The decisions (how many steps, what differed) are pure; `run.py` runs the processes with a
deadline and names the one that hung.
"""
