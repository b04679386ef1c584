"""The old import path of kvrun.run.session (the Session), kept for one release:
importing kvrun.generate gives that very module, so patching one patches the other."""

import sys

from .run import session as _module

sys.modules[__name__] = _module
