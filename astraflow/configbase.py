"""The base of every config section: unknown keys are errors, sections are frozen, and each
field's docstring is its documentation (``astraflow check`` and the CLI show it); numbers are
finite (an infinite timeout or a nan is refused, naming the field)."""

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False)
