"""The one exception type for bad user input; the CLI turns it into exit code 2 and one line."""


class UserInputError(ValueError):
    """Input the user can fix. `key` names the flag, file or dotted config key at fault."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")
