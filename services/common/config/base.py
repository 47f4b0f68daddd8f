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
        # A dotted override's value is read as YAML: `trainer.experiment_name=2024` or
        # `agent.command=[python, a.py, --n, 4]` give numbers where a string is wanted.
        coerce_numbers_to_str=True,
    )
