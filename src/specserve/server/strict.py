"""The base of every request model: strict types, no NaN, ``null`` as the default, integral floats as ints."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


def integral(value: Any) -> Any:
    """JSON has one number type: ``1.0`` is the integer 1 (as JSON Schema says), ``1.5`` is not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, value: Any) -> Any:
        """``"field": null`` means the default, as many OpenAI clients send it; an integral number is an int
        wherever an int is expected (strict mode alone would refuse ``1.0``)."""
        if not isinstance(value, dict):
            return value
        ints = cls._int_fields()
        return {k: integral(v) if k in ints else v for k, v in value.items() if v is not None}

    @classmethod
    def _int_fields(cls) -> frozenset[str]:
        return frozenset(
            name
            for name, f in cls.model_fields.items()
            if f.annotation is int or int in typing.get_args(f.annotation)
        )
