"""Renamed ``executor`` (issue #33); kept until benchmarks/execute.py imports it from there."""

from kvtrace.replay.execute.executor import execute_trace  # moved: kvtrace.replay.execute.executor
