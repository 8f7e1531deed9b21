"""Where the tests find the repository (they run commands from its root)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
