"""Public third-party data shipped in the repository (data/, each folder with its upstream
README and licence)."""

from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
MOONCAKE_SYNTHETIC = DATA / "mooncake" / "synthetic_trace.jsonl"
