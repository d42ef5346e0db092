"""The one exception type users see: a one-line message naming the file and the fix.

Every check of user input raises `UpcyclerError`; the CLI prints it as a single line on stderr and
exits non-zero, without a traceback. Anything else escaping is a bug in upcycler.
"""


class UpcyclerError(Exception):
    """Bad input or environment, with a message that says what is wrong and how to fix it."""
