"""The one exception type for bad user input (the CLI's exit code 2 and one line), and what an interrupt carries back
to the CLI (exit code 130 and one line)."""

import re


class UserInputError(ValueError):
    """Input the user can fix. `key` names the flag, file or dotted config key at fault."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")


class UsageError(UserInputError):
    """A command line argparse refused: `key` the option at fault (None: none in particular), `message` argparse's
    words, and its text argparse's own (`argument --zero: invalid choice: 5 (choose from 0, 1, 2, 3)`), as the CLI
    prints it."""

    def __init__(self, key: str | None, message: str, text: str | None = None):
        super().__init__(key, message)
        self.args = (text or message,)


def error_line(program: str, exc: UserInputError) -> str:
    """The one line a command prints for bad input (`dmt plan: error: --tp: ...`), and `dmt explore` answers. A line
    break a message carries (a value quoted as given, `--time '24:00:00<newline>'`) is written as `\\n`, so that the
    value cannot add a line of its own."""
    return f"{program}: error: {exc}".replace("\r", "\\r").replace("\n", "\\n")


def rename_key(exc: UserInputError, names) -> UserInputError:
    """The same problem under the name the current command gives the key: `names` maps a shared code's key (the
    flag `--gpus` of resolve_plan, say) to this command's (`cluster.gpus` in a recipe, `--tp` in a converter), or is
    a function of the key returning the new name or None."""
    new = names(exc.key) if callable(names) else names.get(exc.key)
    return UserInputError(new, exc.message) if new and new != exc.key else exc


class named_as:  # noqa: N801 (used as `with named_as({...}):`)
    """Context manager: UserInputErrors raised inside carry this command's names for their keys (see rename_key)."""

    def __init__(self, names):
        self.names = names

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, traceback):
        if isinstance(exc, UserInputError):
            renamed = rename_key(exc, self.names)
            if renamed is not exc:
                raise renamed from None
        return False


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) on its way out of a command, with what was undone on the way (children ended, half-made
    outputs removed), for the CLI's one line. A KeyboardInterrupt is one with nothing undone yet."""

    def __init__(self, undone: list[str]):
        self.undone = undone
        super().__init__("; ".join(undone))


def interrupted(exc: BaseException, done: str) -> Interrupted:
    """The interrupt `exc`, with one more thing undone (raise it `from None`: the traceback is nobody's business)."""
    return Interrupted([*getattr(exc, "undone", []), done])


# The one line a toolkit worker prints before it exits on bad input (error_line: toolkit/train.py, `dmt health`
# ranks), or when the NaN/spike guard stops training. Another process's output is text: read back here, beside the
# one function that writes it, and nowhere else
_WORKER_LINE = re.compile(r"^(?:train\.py|dmt [a-z-]+): (?:error|stopped by the guard): (.+?)\s*$")


def worker_error(log_text: str, where: str) -> UserInputError | None:
    """The last such line in a worker's output, as this command's own error (`where`: which launch, its log), so a
    launcher's failure reads as the worker's reason and not only 'see LOG'; None when the worker printed none."""
    lines = [match.group(1) for match in map(_WORKER_LINE.match, log_text.splitlines()) if match]
    if not lines:
        return None
    key, _, message = lines[-1].partition(": ")
    return UserInputError(key, f"{message} ({where})") if message else UserInputError(where, key)
