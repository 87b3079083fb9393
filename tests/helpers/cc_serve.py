"""``ds4 serve`` over the scripted engine answering with :func:`cc_loop.script`
(a tool call on every request): the Claude-Code-shaped loop's server. Started
by path (``python tests/helpers/cc_serve.py <serve's flags>``)."""

import os
import sys

# tests/, for the helpers package (run by path, Python puts tests/helpers/ first)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers import cc_loop, scripted_engine

scripted_engine.script = cc_loop.script  # ScriptedContext looks it up at each reply

from helpers import scripted_serve  # noqa: E402  (patches ds4.server.serve's engine)

if __name__ == "__main__":
    sys.exit(scripted_serve.main(["serve", *sys.argv[1:]]))
