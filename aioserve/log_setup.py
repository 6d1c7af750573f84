"""How aioserve sets up Python's logging, from vLLM's logging arguments and variables.

vLLM 0.32's LoggingConfig arguments (config/logging_args.py) win over the variables; a key
of --logging-config left out takes its variable, as in vLLM:

- configure_logging / VLLM_CONFIGURE_LOGGING (default 1): 0 (false) leaves logging alone, to
  the program around the server (the "aioserve" loggers then propagate to whatever the
  root logger does).
- --log-level, log_level / VLLM_LOGGING_LEVEL (default INFO): the level of the "aioserve"
  logger and its handler.
- formatter (text or json; no variable, default text): json writes one JSON object a line
  with vLLM's fields (asctime, levelname, name, processName, process, message; exc_info and
  stack_info when the record has them; the record's extra attributes), and no prefix.
- VLLM_LOGGING_PREFIX: put before every text line aioserve writes.
- VLLM_LOGGING_STREAM (default ext://sys.stdout; or ext://sys.stderr): where lines go.
- --log-config-file (deprecated in vLLM 0.32: a warning says so), pylogging_config_file /
  VLLM_LOGGING_CONFIG_PATH: a JSON file of `logging.config.dictConfig`, applied after the
  default one (its loggers are aioserve's: "aioserve", "aioserve.access", "aiohttp";
  vLLM's are named "vllm"). Refused when logging is not configured, as vLLM refuses it.

--uvicorn-log-level sets the HTTP layer's level ("aiohttp" and the access log), as
uvicorn's is set in vLLM. A bad value of any of these stops the start with a message
naming the flag or the variable. `serve` sets logging up before the model loads; the
offline `LLM` (and the benchmarks on it) when a logging argument is given.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aioserve.config.declaration import ConfigError
from aioserve.config.engine import LoggingConfig
from aioserve.config.logging_args import LOG_CONFIG_FILE_DEPRECATION

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


@dataclass(frozen=True)
class LogSettings:
    """The logging asked for, each value with what set it (a flag, a key, a variable)."""

    configure: bool
    level: str
    formatter: str
    config_file: str | None
    configure_source: str
    file_source: str


def log_settings(
    args: LoggingConfig | None, environ: Mapping[str, str], *, keywords: bool = False
) -> LogSettings:
    """The arguments' settings, the variables' where they leave a value out; a ConfigError
    naming the flag or variable of a refused one. `keywords`: name LLM(**kwargs)'s."""
    args = args if args is not None else LoggingConfig()
    given = args.logging_config
    key = "logging_config." if keywords else "--logging-config."
    if "configure_logging" in given:
        configure, configure_source = given["configure_logging"], key + "configure_logging"
    else:
        raw = environ.get("VLLM_CONFIGURE_LOGGING", "1").strip()
        if raw not in ("0", "1"):
            raise ConfigError(f"VLLM_CONFIGURE_LOGGING must be 0 or 1, got {raw!r}")
        configure, configure_source = raw == "1", "VLLM_CONFIGURE_LOGGING=0"
    if args.log_config_file is not None:
        config_file = args.log_config_file
        file_source = "log_config_file" if keywords else "--log-config-file"
    elif "pylogging_config_file" in given:
        config_file, file_source = given["pylogging_config_file"], key + "pylogging_config_file"
    else:
        config_file = environ.get("VLLM_LOGGING_CONFIG_PATH") or None
        file_source = "VLLM_LOGGING_CONFIG_PATH"
    if config_file and not configure:
        raise ConfigError(
            f"{file_source} needs logging to be configured: {configure_source} turns it off"
        )
    if args.log_level is not None:
        level = args.log_level
    elif "log_level" in given:
        level = given["log_level"]
    elif configure:
        level = environ.get("VLLM_LOGGING_LEVEL", "INFO").strip().upper()
        if level not in logging.getLevelNamesMapping() or level == "NOTSET":
            raise ConfigError(
                f"VLLM_LOGGING_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {level!r}"
            )
    else:
        level = "INFO"  # unused: logging is left alone
    return LogSettings(
        configure, level, given.get("formatter", "text"), config_file, configure_source,
        file_source,
    )  # fmt: skip


def logging_config(
    http_log_level: str,
    environ: Mapping[str, str],
    args: LoggingConfig | None = None,
    *,
    keywords: bool = False,
) -> dict[str, Any] | None:
    """The `dictConfig` of the server's logging, None when logging is not configured."""
    settings = log_settings(args, environ, keywords=keywords)
    if not settings.configure:
        return None
    stream = environ.get("VLLM_LOGGING_STREAM", _STREAMS[0])
    if stream not in _STREAMS:
        raise ConfigError(f"VLLM_LOGGING_STREAM must be {' or '.join(_STREAMS)}, got {stream!r}")
    http_level = logging.getLevelName(HTTP_LOG_LEVELS[http_log_level])
    if settings.formatter == "json":
        formatter: dict[str, Any] = {"()": JsonLineFormatter}
    else:
        formatter = {
            "format": environ.get("VLLM_LOGGING_PREFIX", "") + _FORMAT,
            "datefmt": _DATE_FORMAT,
        }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"aioserve": formatter},
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
            "aioserve": {"handlers": ["aioserve"], "level": settings.level, "propagate": False},
            # The access log and aiohttp's own: the HTTP layer's level, on the same lines.
            ACCESS_LOGGER: {"level": http_level},
            "aiohttp": {"handlers": ["aioserve"], "level": http_level, "propagate": False},
        },
    }


class JsonLineFormatter(logging.Formatter):
    """vLLM's json formatter (python-json-logger with vLLM's JSON_FORMAT): one JSON object a
    record, its fields asctime, levelname, name, processName, process and message, then
    exc_info and stack_info where present, then the record's extra attributes."""

    _FIELDS = ("asctime", "levelname", "name", "processName", "process", "message")
    # A LogRecord's own attributes: not extras.
    _RECORD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record)
        line = {field: getattr(record, field, None) for field in self._FIELDS}
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc_info"] = record.exc_text
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        for name, value in vars(record).items():
            if name not in self._RECORD_ATTRIBUTES and not name.startswith("_"):
                line[name] = value
        return json.dumps(line, default=str)


def configure_logging(
    http_log_level: str,
    environ: Mapping[str, str] | None = None,
    args: LoggingConfig | None = None,
    *,
    keywords: bool = False,
) -> None:
    """Set up logging as `logging_config` says, then the dictConfig file asked for.
    `keywords`: the arguments are LLM(**kwargs)'s (errors name them so, and the deprecated
    log_config_file is not warned about, as vLLM's LLM does not)."""
    environ = os.environ if environ is None else environ
    config = logging_config(http_log_level, environ, args, keywords=keywords)
    if config is None:
        return
    logging.config.dictConfig(config)
    settings = log_settings(args, environ, keywords=keywords)
    if settings.config_file:
        source, path = settings.file_source, settings.config_file
        try:
            logging.config.dictConfig(_config_file(path, source))
        except (ValueError, TypeError, AttributeError, ImportError) as error:
            raise ConfigError(f"{source} {path}: {error}") from None
    if args is not None and args.log_config_file is not None and not keywords:
        logging.getLogger("aioserve").warning(LOG_CONFIG_FILE_DEPRECATION)


def _config_file(path: str, source: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{source}: no such file: {path}")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"{source} {path} is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"{source} {path} must hold a JSON object (a dictConfig), got {type(config).__name__}"
        )
    config.setdefault("version", 1)
    config.setdefault("disable_existing_loggers", False)
    return config
