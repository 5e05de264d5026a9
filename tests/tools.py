"""The function tools the API tests offer, once; each API family wraps them in its own shape."""

from __future__ import annotations

from typing import Any, Final

WEATHER_NAME: Final = "get_weather"
WEATHER_DESCRIPTION: Final = "Current weather in a city"
# An enum keeps the tiny models' arguments short and checkable.
WEATHER_PARAMETERS: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "celsius": {"type": "boolean"},
    },
    "required": ["city", "celsius"],
    "additionalProperties": False,
}
TIME_NAME: Final = "get_time"
TIME_PARAMETERS: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {"zone": {"type": "integer"}},
    "required": ["zone"],
    "additionalProperties": False,
}
ASK_WEATHER: Final = "What is the weather in Oslo?"
