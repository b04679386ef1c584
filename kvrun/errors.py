"""User-facing errors: the CLI prints them as one line and exits non-zero."""


class KvrunError(Exception):
    """An error caused by the user's input or environment, shown without a traceback."""

    exit_code = 1


class ModelNotFound(KvrunError):
    """A model name or path that resolves to nothing."""

    exit_code = 2


class UnsupportedModel(KvrunError):
    """A model file kvrun can read but cannot run (architecture, tensor type)."""

    exit_code = 3


class ContextOverflow(KvrunError):
    """A prompt (plus generation) longer than the context window."""

    exit_code = 4


class HubError(KvrunError):
    """A pull from the Hugging Face hub that cannot go on; the subclasses say what to do."""


class RepoNotFound(HubError):
    """A Hugging Face repo that does not exist (or is private without a token)."""


class QuantNotFound(HubError):
    """A quant (or file) that a repo does not hold, or that names several of its files."""


class GatedRepo(HubError):
    """A gated repo whose licence is not accepted by the token's user, or no token at all."""


class HubOffline(HubError):
    """A model not in the Hugging Face cache while the hub cannot be reached (or HF_HUB_OFFLINE)."""


class DiskFull(HubError):
    """Not enough room in the Hugging Face cache for a download."""
