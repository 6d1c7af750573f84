"""vLLM 0.32's logging arguments (--logging-config, --log-level, --log-config-file) as
aioserve applies them (aioserve/log_setup.py): they win over the VLLM_* variables as in vLLM,
the json formatter writes one JSON object a line with the fields of vLLM's (python-json-logger
with vLLM's JSON_FORMAT), bad values stop the start naming the flag, and the offline LLM
applies them too. The variables alone: test_log_setup.py.

Each case runs in a child interpreter, whose lines are parsed back: the test process's own
logging stays as pytest set it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from aioserve.config.declaration import ConfigError
from aioserve.config.engine import LoggingConfig, engine_config_from_args
from aioserve.config.parser import build_engine_parser
from aioserve.log_setup import logging_config
from tests.server.conftest import MODEL
from tests.server.openai_helpers import post
from tests.server.serve_process import serve_model

_LOG_SOME = """
import json, logging, os, sys
from aioserve.config.engine import engine_config_from_args
from aioserve.config.parser import build_engine_parser
from aioserve.log_setup import configure_logging
args = build_engine_parser("aioserve serve").parse_args(sys.argv[1:])
configure_logging("info", args=engine_config_from_args(args).logging)
log = logging.getLogger("aioserve")
log.debug("debug line")
log.info("info line from %d", os.getpid())
log.info("with an extra", extra={"request_id": "r-1"})
try:
    1 / 0
except ZeroDivisionError:
    log.exception("it failed")
logging.getLogger("somelib").warning("library warning")
"""

_VARIABLES = ("VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_LEVEL")


def _run(*argv: str, **environ: str) -> subprocess.CompletedProcess:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _VARIABLES and not key.startswith("VLLM_LOGGING")
    }
    return subprocess.run(
        [sys.executable, "-c", _LOG_SOME, *argv],
        env={**env, **environ},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _messages(text: str) -> list[str]:
    return [line.split("] ", 1)[1] for line in text.splitlines() if "] " in line]


def test_the_json_formatter_writes_vllms_fields_one_object_a_line():
    done = _run("--logging-config.formatter", "json", VLLM_LOGGING_PREFIX="[node-7] ")
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]  # no prefix in json
    assert [r["message"] for r in records] == [
        records[0]["message"],
        "with an extra",
        "it failed",
        "library warning",
    ]
    info = records[0]
    assert list(info) == ["asctime", "levelname", "name", "processName", "process", "message"]
    assert info["message"] == f"info line from {info['process']}"
    assert (info["levelname"], info["name"], info["processName"]) == (
        "INFO",
        "aioserve",
        "MainProcess",
    )
    datetime.strptime(info["asctime"], "%Y-%m-%d %H:%M:%S,%f")  # logging's default time
    assert records[1]["request_id"] == "r-1"  # extras follow the fields
    failed = records[2]
    assert failed["levelname"] == "ERROR" and "ZeroDivisionError" in failed["exc_info"]
    assert failed["exc_info"].startswith("Traceback (most recent call last):")
    assert records[3]["name"] == "somelib"


def test_the_flags_win_over_the_variables():
    # --logging-config's level over VLLM_LOGGING_LEVEL, --log-level over both.
    done = _run("--logging-config", '{"log_level": "ERROR"}', VLLM_LOGGING_LEVEL="DEBUG")
    assert _messages(done.stdout)[0] == "it failed"
    done = _run("--logging-config.log_level", "ERROR", "--log-level", "DEBUG")
    assert _messages(done.stdout)[:2] == ["debug line", f"info line from {_pid(done)}"]
    # A variable the flags override is not read, bad or not.
    assert _run("--log-level", "INFO", VLLM_LOGGING_LEVEL="LOUD").returncode == 0
    # configure_logging true over VLLM_CONFIGURE_LOGGING=0, and false over its default.
    done = _run("--logging-config.configure_logging", "true", VLLM_CONFIGURE_LOGGING="0")
    assert "info line" in done.stdout
    done = _run("--logging-config.configure_logging", "false")
    # Python's last-resort handler: warnings and errors only, their bare messages.
    assert done.stdout == "" and "info line" not in done.stderr
    assert "library warning" in done.stderr.splitlines()


def _pid(done: subprocess.CompletedProcess) -> str:
    info = next(m for m in _messages(done.stdout) if m.startswith("info line from "))
    return info.removeprefix("info line from ")


def _dict_config(tmp_path: Path, marker: str) -> Path:
    config = {
        "version": 1,
        "formatters": {"bare": {"format": marker + "|%(name)s|%(message)s"}},
        "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "bare",
                             "stream": "ext://sys.stdout"}},
        "loggers": {"aioserve": {"handlers": ["out"], "level": "DEBUG", "propagate": False}},
    }  # fmt: skip
    path = tmp_path / f"{marker}.json"
    path.write_text(json.dumps(config))
    return path


def test_a_dictconfig_file_from_the_flags(tmp_path):
    variable = _dict_config(tmp_path, "variable")
    key = _dict_config(tmp_path, "key")
    done = _run(
        "--logging-config.pylogging_config_file", str(key), VLLM_LOGGING_CONFIG_PATH=str(variable)
    )
    assert "key|aioserve|debug line" in done.stdout.splitlines()
    assert "variable|" not in done.stdout
    # The deprecated --log-config-file wins over the key, and says it is deprecated.
    done = _run(
        "--logging-config.pylogging_config_file", str(key), "--log-config-file", str(variable)
    )
    lines = done.stdout.splitlines()
    assert "variable|aioserve|debug line" in lines and "key|" not in done.stdout
    assert (
        "variable|aioserve|--log-config-file is deprecated and will be removed in v0.33.0. "
        "Use --logging-config.pylogging_config_file instead." in lines
    )
    # null: no file, even where the variable names one.
    done = _run(
        "--logging-config",
        '{"pylogging_config_file": null}',
        VLLM_LOGGING_CONFIG_PATH=str(variable),
    )
    assert "variable|" not in done.stdout and "info line" in done.stdout


def test_a_missing_file_stops_the_start_naming_the_flag(tmp_path):
    done = _run("--log-config-file", str(tmp_path / "none.json"))
    assert done.returncode != 0
    assert f"--log-config-file: no such file: {tmp_path / 'none.json'}" in done.stderr


def _config(*argv: str) -> LoggingConfig:
    return engine_config_from_args(build_engine_parser("aioserve serve").parse_args(argv)).logging


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--log-level", "debug"], "--log-level must be one of CRITICAL, ERROR, WARNING, INFO, DEBUG, NOTSET; got 'debug'"),
        (["--logging-config.formatter", "xml"], "--logging-config key 'formatter' must be one of text, json, got 'xml'"),
        (["--logging-config.log_level", "LOUD"], "--logging-config key 'log_level' must be one of CRITICAL"),
        (["--logging-config.configure_logging", "0"], "--logging-config key 'configure_logging' must be true or false"),
        (["--logging-config.colour", "1"], "--logging-config has no key 'colour'"),
        (["--logging-config.configure_logging", "false", "--log-config-file", "/x.json"],
         "--log-config-file needs logging to be configured, but --logging-config.configure_logging is false"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ConfigError) as error:
        _config(*argv)
    assert message in str(error.value)


def test_a_variable_that_conflicts_with_a_flag_is_named_with_it():
    args = _config("--logging-config.configure_logging", "false")
    with pytest.raises(ConfigError) as error:
        logging_config("info", {"VLLM_LOGGING_CONFIG_PATH": "/x.json"}, args)
    assert str(error.value) == (
        "VLLM_LOGGING_CONFIG_PATH needs logging to be configured: "
        "--logging-config.configure_logging turns it off"
    )


_OFFLINE = """
import logging, sys
from aioserve.engine.llm import LLM
from aioserve.engine.sampling_params import SamplingParams
llm = LLM(
    sys.argv[1], max_model_len=256, enforce_eager=True, dtype="float32",
    logging_config={"formatter": "json"}, log_level="DEBUG",
    profiler_config={"profiler": "torch", "torch_profiler_dir": sys.argv[2],
                     "torch_profiler_use_gzip": False},
)
logging.getLogger("aioserve").debug("offline debug line")
llm.start_profile()
llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
llm.stop_profile()
"""


def test_the_offline_llm_applies_them(smollm2_gguf, tmp_path):
    # As vLLM's LLM: its logging and profiler arguments (LLM.start_profile/stop_profile).
    env = {k: v for k, v in os.environ.items() if k not in _VARIABLES}
    done = subprocess.run(
        [sys.executable, "-c", _OFFLINE, str(smollm2_gguf), str(tmp_path / "traces")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert records[0]["name"] == "aioserve"  # the engine's own lines, from the start
    assert ("DEBUG", "offline debug line") in [(r["levelname"], r["message"]) for r in records]
    [trace] = (tmp_path / "traces").glob("*.pt.trace.json")
    events = json.loads(trace.read_bytes())["traceEvents"]
    assert [e for e in events if e.get("name") == "aten::mm"]  # the model's steps


def _stats_lines(log: Path) -> list[str]:
    text = log.read_text()
    return [line for line in text.splitlines() if "Avg prompt throughput" in line]


def test_serve_writes_json_lines_and_stats_at_vllms_interval(smollm2_gguf, tmp_path):
    log = tmp_path / "serve.log"
    options = ("--max-model-len", "256", "--enforce-eager", "--logging-config.formatter", "json")
    env = {"VLLM_LOG_STATS_INTERVAL": "0.4"}  # vLLM's variable; 10 s without it
    with serve_model(smollm2_gguf, MODEL, log, *options, env=env) as url:
        assert post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status == 200
        # The access line follows the response: wait for it before the server is killed,
        # and for the stats lines: one with the request's throughput, one after it.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
            "POST /v1/completions" not in log.read_text() or len(_stats_lines(log)) < 2
        ):
            time.sleep(0.05)
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    stats = [r for r in records if "Avg prompt throughput" in r["message"]]
    assert len(stats) >= 2 and stats[0]["name"] == "aioserve.stats"
    assert "Avg generation throughput" in stats[0]["message"]
    names = {(r["name"], r["levelname"]) for r in records}
    assert ("aioserve", "INFO") in names and ("aioserve.access", "INFO") in names
    access = [r["message"] for r in records if r["name"] == "aioserve.access"]
    assert [m for m in access if "POST /v1/completions" in m]
    assert not [line for line in log.read_text().splitlines() if line.startswith("INFO ")]
