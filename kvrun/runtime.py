"""The old import path of kvrun.run.runtime (the Runtime), kept for one release:
importing kvrun.runtime gives that very module, so patching one patches the other."""

import sys

from .run import runtime as _module

sys.modules[__name__] = _module
