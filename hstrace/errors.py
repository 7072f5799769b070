"""Errors that mean "the input is bad", as opposed to a bug in hstrace.

The CLI turns any `HstraceError` into one line on stderr and exit code 2; nothing else may
reach the user as a traceback for bad input.
"""


class HstraceError(Exception):
    """Bad input or usage: a corrupt trace, a wrong checkpoint, mismatched shapes, an unsupported
    engine version. The message is shown to the user as is, so make it one self-contained line
    that names the offending path or value."""


class TraceError(HstraceError):
    """A trace store that cannot be read: missing, corrupt, truncated, or of an unknown schema."""


class CheckpointError(HstraceError):
    """A drafter checkpoint that cannot be loaded or understood."""


class TrainingDataError(HstraceError):
    """A training-data directory whose layout is unknown or whose files are corrupt."""


class EngineError(HstraceError):
    """A serving engine that hstrace cannot hook: missing, or a version without a patch table."""
