"""The one exception type users see.

Every mistake a user can make (a bad model file, a malformed argument, a plan that does not
match the model, a cluster too small) raises `PlannerError` with a message that says what is
wrong and what to do. The CLI prints that paragraph and exits non-zero; a Python traceback
appears only with `--debug`. Internal invariants use `assert`, never this type.
"""

from __future__ import annotations


class PlannerError(Exception):
    """A user-facing error: `message` says what is wrong, `hint` what to change."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n{self.hint}"
