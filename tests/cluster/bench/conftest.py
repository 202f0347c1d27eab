"""The serving benchmark runs against the router tests' in-process fake workers."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "router"))  # router_fakes
