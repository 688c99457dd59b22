"""loraplane's tests; the folders mirror the packages (``tests/control/app`` tests ``control.app``).

``REPO`` is the repository root, for tests that read committed files or start commands in it.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
