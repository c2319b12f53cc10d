"""The one base class of the mistakes a user makes (a bad setting, model file, prompt file or flag).

The command line prints such an error as one line, ``specserve: error: …``, and exits with status 2; any
other exception is a bug and keeps its traceback. Each room raises its own subclass.
"""


class UserError(Exception):
    """A mistake of the user's, reported as one line without a traceback."""
