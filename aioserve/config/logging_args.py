"""vLLM 0.32's LoggingConfig arguments: --logging-config, --log-level, --log-config-file.

--logging-config is a JSON object (or its keys one by one: `--logging-config.log_level
DEBUG`) with vLLM's four keys: log_level, formatter ("text" or "json"), configure_logging
and pylogging_config_file. --log-level overrides its log_level, --log-config-file (deprecated
in vLLM 0.32) its pylogging_config_file. A key left out takes its VLLM_* environment
variable when logging is set up (aioserve/log_setup.py), as vLLM's LoggingConfig defaults do.
This module checks the values; it reads no environment.
"""

from __future__ import annotations

from typing import Any

from aioserve.config import values

LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")
FORMATTERS = ("text", "json")
LOG_CONFIG_FILE_DEPRECATION = (
    "--log-config-file is deprecated and will be removed in v0.33.0. "
    "Use --logging-config.pylogging_config_file instead."
)  # vLLM 0.32's words


def _optional_path(value: Any) -> str | None:
    return None if value is None else values.string(value)


def _log_level(value: Any) -> str:
    if value not in LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return value


logging_config = values.json_settings(
    {
        "log_level": _log_level,
        "formatter": values.one_of(*FORMATTERS),
        "configure_logging": values.boolean,
        # null: no file, even where VLLM_LOGGING_CONFIG_PATH names one
        "pylogging_config_file": _optional_path,
    }
)
"""--logging-config: the keys given, checked (the others come from the environment)."""
