"""Base class of every config section: strict, documented, assignment-validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigModel(BaseModel):
    """A config section. Unknown keys are errors; each field's docstring is its description."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
        validate_default=True,
    )
