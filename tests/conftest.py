import sys
from pathlib import Path

# Test helper modules (tests/*.py that are not tests) import as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))
