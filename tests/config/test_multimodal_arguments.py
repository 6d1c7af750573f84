"""--limit-mm-per-prompt and --allowed-local-media-path (config/multimodal.py): vLLM 0.32's
forms taken (a count, or {"count": n}), what aioserve cannot honour refused naming the
flag, on the command line and as LLM(...) keywords alike."""

from __future__ import annotations

import argparse

import pytest

from aioserve.config.declaration import ConfigError
from aioserve.config.engine import engine_config_from_args, engine_config_from_kwargs
from aioserve.config.parser import add_engine_arguments


def _config(*argv: str):
    parser = argparse.ArgumentParser(prog="test", allow_abbrev=False)
    add_engine_arguments(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_counts_in_either_form(tmp_path):
    config = _config(
        "--limit-mm-per-prompt",
        '{"image": {"count": 3}, "video": 0}',
        "--allowed-local-media-path",
        str(tmp_path),
    )
    assert config.model.limit_mm_per_prompt == {"image": 3, "video": 0}
    assert config.model.allowed_local_media_path == str(tmp_path.resolve())
    keywords = engine_config_from_kwargs(limit_mm_per_prompt={"image": 3})
    assert keywords.model.limit_mm_per_prompt == {"image": 3}
    assert _config().model.allowed_local_media_path == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--limit-mm-per-prompt", '{"image": -1}'], "--limit-mm-per-prompt"),
        (["--limit-mm-per-prompt", '{"image": -1}'], "at least 0, got -1"),
        (["--limit-mm-per-prompt", '{"images": 2}'], "'images' is not a modality"),
        (
            ["--limit-mm-per-prompt", '{"image": {"count": 1, "width": 512}}'],
            "key 'width' (a size for vLLM's memory profiling) is not supported",
        ),
        (["--limit-mm-per-prompt", '{"image": true}'], "an integer of at least 0, got True"),
        (["--allowed-local-media-path", "/no/such/folder"], "'/no/such/folder' is not a folder"),
    ],
)
def test_refused_naming_the_flag(argv, message):
    with pytest.raises(ConfigError) as error:
        _config(*argv)
    assert message in str(error.value)
