"""The one exception type whose message is shown to users as-is."""


class DeltafyError(Exception):
    """Bad input or an unmet precondition; the message says what to do about it."""
