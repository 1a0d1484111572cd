"""Make ``tests/dist_utils.py`` and ``kernel_cases.py`` importable whatever pytest's import mode."""

import sys
from pathlib import Path

for _path in (Path(__file__).resolve().parent, Path(__file__).resolve().parent.parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
