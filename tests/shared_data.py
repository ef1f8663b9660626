"""Public third-party data the project is given beside the repository (../shared/data)."""

from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
MOONCAKE_SYNTHETIC = SHARED_DATA / "mooncake" / "synthetic_trace.jsonl"
