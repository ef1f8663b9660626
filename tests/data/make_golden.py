"""Writes the golden traces of this format version. Run once per trace format version, then
commit: older golden files must keep decoding (tests/test_traceio.py) and loading into DuckDB
with every shipped query answering (tests/test_sql_queries.py) forever.

- golden-v<MAJOR>.kvtrace: one record of every kind;
- forensics-v<MAJOR>-{unfixed,fixed}.kvtrace: the hand-built eviction scenario of
  tests/test_analysis_scenario.py plus a stale-key hazard, one replay per variant."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from trace_samples import one_of_each_kind, sample_header  # noqa: E402

from test_analysis_scenario import header, scenario  # noqa: E402

from kvtrace.events import FORMAT_MAJOR, StaleKeyLeft  # noqa: E402
from kvtrace.traceio import TraceWriter, write_trace  # noqa: E402


def forensics_records(variant: str) -> list:
    records = scenario(unfixed=variant == "unfixed")
    if variant == "unfixed":
        records.insert(30, StaleKeyLeft(2, 1, 4, 103, 32, 48))  # so every query has rows
    return records


if __name__ == "__main__":
    path = Path(__file__).parent / f"golden-v{FORMAT_MAJOR}.kvtrace"
    with TraceWriter(path, sample_header(), batch_size=7) as writer:
        writer.write_many(one_of_each_kind())
    print(f"wrote {path}")
    for variant in ("unfixed", "fixed"):
        path = Path(__file__).parent / f"forensics-v{FORMAT_MAJOR}-{variant}.kvtrace"
        write_trace(path, header(variant), forensics_records(variant))
        print(f"wrote {path}")
