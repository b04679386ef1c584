"""The old import path of kvrun.models.model (the decoder), kept for one release:
importing kvrun.model gives that very module, so patching one patches the other."""

import sys

from .models import model as _module

sys.modules[__name__] = _module
