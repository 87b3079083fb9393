"""The suite's tiers (tests/conftest.py): every module named slow exists,
and a module that loads a real model through llama.cpp, starts a Redis
server or runs the CLI in a subprocess is slow, so ``bash scripts/test.sh
--quick`` stays the inner loop's."""

from __future__ import annotations

import pathlib
import re

from conftest import SLOW_MODULES

HERE = pathlib.Path(__file__).resolve().parent
HEAVY = re.compile(r"LlamaCppEngine|models\.engine|models\.world|RedisNode|RedisClusterNodes|\bds4_cmd\b|\bds4_json\b")


def test_every_slow_module_exists():
    assert SLOW_MODULES <= {p.stem for p in HERE.glob("test_*.py")}


def test_a_module_of_real_models_servers_or_subprocesses_is_slow():
    heavy = {p.stem for p in HERE.glob("test_*.py") if HEAVY.search(p.read_text()) and p.stem != "test_suite_tiers"}
    assert heavy - SLOW_MODULES == set()
