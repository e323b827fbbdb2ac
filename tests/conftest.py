"""Shared fixtures (the helpers they build on: tests/helpers/)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.models import TINY_CASES

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the Hub is never reachable from the test machines
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Nearly every test runs tiny models, where thread start-up costs more than the math, and the
# 2-core test machines are often shared: one intra-op thread for the whole session.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _environment_restored():
    """Tests that run the command line in this process (``main([...])``) get its start-up settings
    (quiet.py sets TRANSFORMERS_VERBOSITY and others for the rest of a run): a later test's child
    process must not inherit them, nor any other variable a test left behind."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(params=sorted(TINY_CASES))
def case(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A trained tiny tokenizer, a tiny llama and its deltafy conversion (tests/helpers/training.py)."""
    from helpers.training import tiny_setup

    return tiny_setup(tmp_path_factory)


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory):
    """A private token cache for a test module (DELTAFY_CACHE), so cache tests start empty."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DELTAFY_CACHE", str(tmp_path_factory.mktemp("token-cache")))
        yield
