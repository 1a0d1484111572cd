"""Make ``tests/dist_utils.py`` and ``conversion_helpers`` importable whatever pytest's rootdir."""

import sys
from pathlib import Path

for _path in (Path(__file__).resolve().parent.parent, Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
