"""What every config section is (a pydantic model that forbids unknown keys) and the error a config that cannot
be used raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration that cannot be used; the message is meant for the user as is."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
