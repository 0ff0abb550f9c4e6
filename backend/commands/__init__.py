"""The ``python -m pipetrain`` commands that belong to no other room: check-config, doctor, demo, launch (several
machines)."""
