"""Per-stage GPU memory from a meta-device trace, ``memory = "auto"`` and the ``memory-plan`` command."""
