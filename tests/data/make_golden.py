"""Writes tests/data/golden-v<MAJOR>.kvtrace. Run once per trace format version, then commit:
older golden files must keep decoding forever (tests/test_traceio.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from trace_samples import one_of_each_kind, sample_header  # noqa: E402

from kvtrace.events import FORMAT_MAJOR  # noqa: E402
from kvtrace.traceio import TraceWriter  # noqa: E402

if __name__ == "__main__":
    path = Path(__file__).parent / f"golden-v{FORMAT_MAJOR}.kvtrace"
    with TraceWriter(path, sample_header(), batch_size=7) as writer:
        writer.write_many(one_of_each_kind())
    print(f"wrote {path}")
