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
