"""``ds4 serve`` over :class:`scripted_engine.ScriptedEngine` (the agent
tests' server processes): the same command line, another engine. Started by
path (``python tests/helpers/scripted_serve.py <serve's flags>``)."""

import os
import sys

# tests/, for the helpers package (run by path, Python puts tests/helpers/ first)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ds4.server.serve as app
from ds4.cli import main
from helpers.scripted_engine import QWEN3_LIKE, ScriptedEngine

TEMPLATE = {"qwen3": QWEN3_LIKE}.get(os.environ.get("DS4_SCRIPTED_TEMPLATE", ""))
app.build_engine = lambda *a, **k: ScriptedEngine(template=TEMPLATE)  # type: ignore[assignment]
app.engine_model_id = lambda e: "ds4-scripted"  # type: ignore[assignment]

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
