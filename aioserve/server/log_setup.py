"""How `aioserve serve` sets up Python's logging, from vLLM's environment variables.

- VLLM_CONFIGURE_LOGGING (default 1): 0 leaves logging alone, to the program around the
  server (the "aioserve" loggers then propagate to whatever the root logger does).
- VLLM_LOGGING_LEVEL (default INFO): the level of the "aioserve" logger and its handler.
- VLLM_LOGGING_PREFIX: put before every line aioserve writes.
- VLLM_LOGGING_STREAM (default ext://sys.stdout; or ext://sys.stderr): where lines go.
- VLLM_LOGGING_CONFIG_PATH: a JSON file of `logging.config.dictConfig`, applied after the
  default one (its loggers are aioserve's: "aioserve", "aioserve.access", "aiohttp";
  vLLM's are named "vllm"). Refused with VLLM_CONFIGURE_LOGGING=0, as vLLM refuses it.

--uvicorn-log-level sets the HTTP layer's level ("aiohttp" and the access log), as
uvicorn's is set in vLLM. A bad value of any of these stops the start with a message
naming the variable.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aioserve.config.declaration import ConfigError

ACCESS_LOGGER = "aioserve.access"
_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"
_STREAMS = ("ext://sys.stdout", "ext://sys.stderr")
HTTP_LOG_LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def logging_config(http_log_level: str, environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The `dictConfig` of the server's logging, None when VLLM_CONFIGURE_LOGGING is 0."""
    configure = environ.get("VLLM_CONFIGURE_LOGGING", "1").strip()
    if configure not in ("0", "1"):
        raise ConfigError(f"VLLM_CONFIGURE_LOGGING must be 0 or 1, got {configure!r}")
    if configure == "0":
        if environ.get("VLLM_LOGGING_CONFIG_PATH"):
            raise ConfigError(
                "VLLM_LOGGING_CONFIG_PATH needs logging to be configured: unset "
                "VLLM_CONFIGURE_LOGGING=0 (or VLLM_LOGGING_CONFIG_PATH)"
            )
        return None
    level = environ.get("VLLM_LOGGING_LEVEL", "INFO").strip().upper()
    if level not in logging.getLevelNamesMapping() or level == "NOTSET":
        raise ConfigError(
            f"VLLM_LOGGING_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {level!r}"
        )
    stream = environ.get("VLLM_LOGGING_STREAM", _STREAMS[0])
    if stream not in _STREAMS:
        raise ConfigError(f"VLLM_LOGGING_STREAM must be {' or '.join(_STREAMS)}, got {stream!r}")
    http_level = logging.getLevelName(HTTP_LOG_LEVELS[http_log_level])
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "aioserve": {
                "format": environ.get("VLLM_LOGGING_PREFIX", "") + _FORMAT,
                "datefmt": _DATE_FORMAT,
            }
        },
        "handlers": {
            "aioserve": {
                "class": "logging.StreamHandler",
                "formatter": "aioserve",
                "stream": stream,
            }
        },
        # Other libraries' warnings on the same lines, as before any of this was read.
        "root": {"handlers": ["aioserve"], "level": "WARNING"},
        "loggers": {
            "aioserve": {"handlers": ["aioserve"], "level": level, "propagate": False},
            # The access log and aiohttp's own: the HTTP layer's level, on the same lines.
            ACCESS_LOGGER: {"level": http_level},
            "aiohttp": {"handlers": ["aioserve"], "level": http_level, "propagate": False},
        },
    }


def configure_logging(http_log_level: str, environ: Mapping[str, str] | None = None) -> None:
    """Set up logging as `logging_config` says, then the file of VLLM_LOGGING_CONFIG_PATH."""
    environ = os.environ if environ is None else environ
    config = logging_config(http_log_level, environ)
    if config is None:
        return
    logging.config.dictConfig(config)
    path = environ.get("VLLM_LOGGING_CONFIG_PATH")
    if path:
        try:
            logging.config.dictConfig(_config_file(path))
        except (ValueError, TypeError, AttributeError, ImportError) as error:
            raise ConfigError(f"VLLM_LOGGING_CONFIG_PATH {path}: {error}") from None


def _config_file(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"VLLM_LOGGING_CONFIG_PATH: no such file: {path}")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"VLLM_LOGGING_CONFIG_PATH {path} is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"VLLM_LOGGING_CONFIG_PATH {path} must hold a JSON object (a dictConfig), "
            f"got {type(config).__name__}"
        )
    config.setdefault("version", 1)
    config.setdefault("disable_existing_loggers", False)
    return config
