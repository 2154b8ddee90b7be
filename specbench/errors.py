"""User-facing errors: the CLI prints their message on one line and exits with status 2."""


class UserError(Exception):
    """Bad input from the user (unknown name, malformed file, impossible setting)."""
