"""The data package's error type, so callers can tell "your data is wrong" from other failures."""

from megalite.errors import MegaliteError


class DataError(MegaliteError):
    """A missing, corrupt or mismatched data file; the message names the path and the fix."""
