"""The one exception type that means "the user gave us something wrong"."""


class UserError(ValueError):
    """A bad input. The command line prints it as one `error: ...` line and exits 2."""
