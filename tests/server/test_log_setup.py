"""vLLM's logging variables as `aioserve serve` reads them (aioserve/log_setup.py): the level,
prefix and stream of aioserve's lines, a dictConfig file applied after them, logging left
alone with VLLM_CONFIGURE_LOGGING=0, and every bad value refused naming its variable; and
VLLM_LOG_STATS_INTERVAL, the period of the stats line (served: test_logging_flags.py).

Each case runs in a child interpreter, which sets up its logging as the server does and
writes a few records: the test process's own logging stays as pytest set it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from aioserve.config.declaration import ConfigError
from aioserve.config.frontend import log_stats_interval
from aioserve.log_setup import logging_config

_LOG_SOME = """
import logging, sys
from aioserve.log_setup import configure_logging
configure_logging(sys.argv[1])
logging.getLogger("aioserve").debug("debug line")
logging.getLogger("aioserve").info("info line")
logging.getLogger("aioserve.access").info("access line")
logging.getLogger("somelib").warning("library warning")
logging.getLogger("somelib").info("library info")
"""


def _run(environ: dict[str, str], http_level: str = "info") -> subprocess.CompletedProcess:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("VLLM_LOGGING") and key != "VLLM_CONFIGURE_LOGGING"
    }
    return subprocess.run(
        [sys.executable, "-c", _LOG_SOME, http_level],
        env={**env, **environ},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_by_default_info_lines_go_to_stdout_in_vllms_order_of_fields():
    done = _run({})
    lines = done.stdout.splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == [
        "info line",
        "access line",
        "library warning",
    ]
    assert lines[0].startswith("INFO ") and "[aioserve] info line" in lines[0]
    assert done.stderr == ""


def test_level_prefix_and_stream():
    done = _run(
        {
            "VLLM_LOGGING_LEVEL": "debug",
            "VLLM_LOGGING_PREFIX": "[node-7] ",
            "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        },
        http_level="warning",
    )
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert all(line.startswith("[node-7] ") for line in lines)
    # The access log follows --uvicorn-log-level (warning), not VLLM_LOGGING_LEVEL.
    assert [line.split("] ", 2)[2] for line in lines] == [
        "debug line",
        "info line",
        "library warning",
    ]


def test_a_warning_level_hides_info_lines():
    done = _run({"VLLM_LOGGING_LEVEL": "WARNING"})
    assert "info line" not in done.stdout and "library warning" in done.stdout


def test_configure_logging_0_leaves_logging_alone():
    done = _run({"VLLM_CONFIGURE_LOGGING": "0"})
    assert done.stdout == ""
    # Python's last-resort handler: warnings only, as for any unconfigured program.
    assert done.stderr.splitlines() == ["library warning"]


def test_a_dictconfig_file_is_applied_after_the_default(tmp_path):
    config = {
        "version": 1,
        "formatters": {"bare": {"format": "custom|%(name)s|%(message)s"}},
        "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "bare",
                             "stream": "ext://sys.stdout"}},
        "loggers": {"aioserve": {"handlers": ["out"], "level": "DEBUG", "propagate": False}},
    }  # fmt: skip
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    done = _run({"VLLM_LOGGING_CONFIG_PATH": str(path)})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "custom|aioserve|debug line" in lines
    assert "custom|aioserve.access|access line" in lines


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"VLLM_CONFIGURE_LOGGING": "yes"}, "VLLM_CONFIGURE_LOGGING must be 0 or 1, got 'yes'"),
        ({"VLLM_LOGGING_LEVEL": "LOUD"},
         "VLLM_LOGGING_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got 'LOUD'"),
        ({"VLLM_LOGGING_STREAM": "/tmp/x"},
         "VLLM_LOGGING_STREAM must be ext://sys.stdout or ext://sys.stderr, got '/tmp/x'"),
        ({"VLLM_CONFIGURE_LOGGING": "0", "VLLM_LOGGING_CONFIG_PATH": "/etc/x.json"},
         "VLLM_LOGGING_CONFIG_PATH needs logging to be configured"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_variable(environ, message):
    with pytest.raises(ConfigError) as error:
        logging_config("info", environ)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "VLLM_LOGGING_CONFIG_PATH: no such file"),
        ("{oops", "is not JSON"),
        ("[1, 2]", "must hold a JSON object (a dictConfig), got list"),
        ('{"handlers": {"h": {"class": "no.such.Handler"}}}', "VLLM_LOGGING_CONFIG_PATH "),
    ],
)
def test_a_bad_config_file_stops_the_start_naming_it(tmp_path, content, message):
    path = tmp_path / "logging.json"
    if content is not None:
        path.write_text(content)
    done = _run({"VLLM_LOGGING_CONFIG_PATH": str(path)})
    assert done.returncode != 0
    assert "ConfigError" in done.stderr and message in done.stderr


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [(None, 10.0), ("2.5", 2.5), ("1", 1.0), ("0", 10.0), ("-3", 10.0), (" 7 ", 7.0)],
)
def test_stats_interval_is_read_as_vllm_reads_it(raw, seconds):
    environ = {} if raw is None else {"VLLM_LOG_STATS_INTERVAL": raw}
    assert log_stats_interval(environ) == seconds


@pytest.mark.parametrize("raw", ["soon", "", "nan", "inf"])
def test_a_stats_interval_that_is_not_a_number_stops_the_start(raw):
    with pytest.raises(ConfigError, match=r"^VLLM_LOG_STATS_INTERVAL must be a number of seconds"):
        log_stats_interval({"VLLM_LOG_STATS_INTERVAL": raw})
    done = subprocess.run(
        [sys.executable, "-m", "aioserve", "serve", "no/such-model"],
        env=os.environ | {"VLLM_LOG_STATS_INTERVAL": raw},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: VLLM_LOG_STATS_INTERVAL must be a number of seconds" in done.stderr
