"""Makes the helpers next to the tests (moe_tiny.py) importable; the rank scripts import them too."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
