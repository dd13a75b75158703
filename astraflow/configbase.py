"""The base of every config section: unknown keys are errors, sections are frozen, and each
field's docstring is its documentation (``astraflow check`` and the CLI show it)."""

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
