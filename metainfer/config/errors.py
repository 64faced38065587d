"""The one error type for bad engine options."""


class ConfigError(ValueError):
    """A bad engine option (the message names the field). A ValueError, so callers of `LLM(...)` catch it
    as one; the CLI prints it as one line instead of a traceback."""
