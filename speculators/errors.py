"""User-facing errors: one clear sentence naming the bad value and the fix."""


class SpeculatorsError(Exception):
    """A mistake the user can fix (bad path, bad flag, inconsistent checkpoint).

    The CLI prints these as one line without a traceback; anything else is a bug.
    """


class CheckpointFormatError(SpeculatorsError):
    """A speculator checkpoint that does not follow the speculators format."""

    def __init__(self, problems: list[str], path: str | None = None):
        self.problems = list(problems)
        where = f" {path}" if path else ""
        detail = "; ".join(self.problems)
        super().__init__(f"checkpoint{where} is not a valid speculator: {detail}")
