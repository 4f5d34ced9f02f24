"""The one error type a user sees: a single clear line, never a traceback."""


class UserError(Exception):
    """Bad input or an environment problem the user can fix; the CLI prints ``error: <message>``.

    :param message: one line that says what is wrong and, where possible, what to do
    :param exit_code: the process exit status (2 for bad arguments, 1 for "cannot proceed")
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
