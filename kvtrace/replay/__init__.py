"""Replay: re-execute traffic against a prefix-cache backend under a checkpoint variant."""
