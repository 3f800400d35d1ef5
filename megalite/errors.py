"""The one exception type users see: every bad input becomes a MegaliteError with a message that
names the problem and the fix, and the CLI turns it into `error: ...` with exit code 2."""


class MegaliteError(Exception):
    """A user-facing error: bad config, bad data, bad checkpoint, impossible layout."""
