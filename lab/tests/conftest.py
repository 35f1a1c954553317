"""Shared by the lab's tests.

Under `pants test`, source roots are on sys.path as paths relative to the sandbox. Tests that run
Python in a subprocess (with another cwd) pass sys.path on as PYTHONPATH, so make the entries
absolute once, here.
"""

import os
import sys

sys.path[:] = [os.path.abspath(path) if path else path for path in sys.path]
