"""A flight recorder's ring directory: the names of its segments, and which ones it holds.

``kvtrace capture --ring 30m --dir D`` has the engine write its capture in segments, one file
each, named ``ring-<session>-<seq>.kvtrace``: ``session`` is the capture's start
(``TraceHeader.created_ns``, 19 digits, so that names sort by time) and ``seq`` the segment's
number in it (from 1, 6 digits). Every segment is a whole trace of its own that opens with a
keyframe (a start snapshot), and every record's time counts from the session's start, so the
segments of one session join into one trace (``kvtrace dump``). The newest segment of the
newest session may be the one being written: its reader sees it cut at its last whole frame.
Incident traces written by a trigger go to ``D/incidents``.

Imported on both sides (the engine writes and prunes, the operator lists and reads): stdlib
only.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

SEGMENT_SUFFIX = ".kvtrace"
INCIDENTS_DIR = "incidents"
_SEGMENT_NAME = re.compile(r"ring-(\d{19})-(\d{6})\.kvtrace")


class Segment(NamedTuple):
    """One segment file of a ring: its name in the ring directory, its session, its number."""

    name: str
    session: int
    seq: int


def segment_name(session: int, seq: int) -> str:
    return f"ring-{session:019d}-{seq:06d}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> Segment | None:
    """The segment ``name`` names; None for any other file (ignored: a ring directory may hold
    the operator's own files, and the incidents directory)."""
    match = _SEGMENT_NAME.fullmatch(name)
    return None if match is None else Segment(name, int(match.group(1)), int(match.group(2)))


def list_segments(dir_fd_or_path: int | str | os.PathLike) -> list[Segment]:
    """The segments in a ring directory (a path, or a descriptor open on it), oldest first."""
    names = os.listdir(dir_fd_or_path)
    return sorted(segment for segment in map(parse_segment_name, names) if segment is not None)
