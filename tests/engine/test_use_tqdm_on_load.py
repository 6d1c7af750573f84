"""--use-tqdm-on-load: the weights' progress bar is drawn unless it is turned off (vLLM's
default on), for generative and pooling models alike."""

from __future__ import annotations

import pytest

from aioserve import LLM
from aioserve.config.engine import engine_config_from_kwargs
from aioserve.config.parser import build_engine_parser
from aioserve.models import loader


@pytest.fixture
def bars(monkeypatch) -> list[str]:
    """The description of every progress bar the loader draws."""
    drawn: list[str] = []

    def recording_tqdm(iterable, **options):
        drawn.append(options["desc"])
        return iterable

    monkeypatch.setattr(loader, "tqdm", recording_tqdm)
    return drawn


@pytest.mark.parametrize(
    ("option", "expected"), [({}, ["Loading weights"]), ({"use_tqdm_on_load": False}, [])]
)
def test_the_loader_draws_its_bar_unless_told_not_to(tiny_model, bars, option, expected):
    LLM(model=tiny_model, dtype="float32", max_model_len=64, enforce_eager=True, **option).close()
    assert bars == expected


def test_pooling_models_take_it_too(minilm_folder, bars):
    LLM(
        model=str(minilm_folder), dtype="float32", enforce_eager=True, use_tqdm_on_load=False
    ).close()
    assert bars == []


def test_the_flag_and_its_negation_parse():
    parser = build_engine_parser("aioserve serve")
    assert engine_config_from_kwargs().load.use_tqdm_on_load is True
    for argv, expected in ((["--no-use-tqdm-on-load"], False), (["--use-tqdm-on-load"], True)):
        assert vars(parser.parse_args(argv))["use_tqdm_on_load"] is expected
