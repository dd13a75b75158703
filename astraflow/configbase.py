"""The base of every config section: unknown keys are errors, sections are frozen, and each
field's docstring is its documentation (``astraflow check`` and the CLI show it); numbers are
finite (an infinite timeout or a nan is refused, naming the field) and never booleans (YAML's
``true`` is refused where a number is wanted, not taken as 1)."""

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from astraflow.configerrors import refuse_bools


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """A boolean where a field wants a number (also in a list or mapping of numbers, or in a
        section that is not a ``Strict`` one) fails the field: pydantic would take it as 1 or 0,
        and checks across fields would then judge that made-up number."""
        if isinstance(value, (bool, dict, list)) and info.field_name is not None:
            refuse_bools(value, cls.model_fields[info.field_name].annotation, stop=Strict)
        return value
