"""``ds4 serve``: an OpenAI-compatible HTTP server over a pool of live sessions (one with ``--sessions 1``).

- :mod:`ds4.server.app`: the routes (Starlette);
- :mod:`ds4.server.serve`: ``ds4 serve``'s command line and ``serve_main``;
- :mod:`ds4.server.worker`: the job queue and the one thread that owns the
  session (through :class:`ds4.turn.TurnDriver`);
- :mod:`ds4.server.wire`: what every protocol shares (the parsed request,
  errors, the ``ds4`` block, server-sent events);
- :mod:`ds4.server.openai`, :mod:`ds4.server.anthropic`,
  :mod:`ds4.server.responses`: the protocols, siblings over ``wire``. A later
  protocol is one more module beside them;
- :mod:`ds4.server.metrics`, :mod:`ds4.server.ui`: ``GET /metrics``
  (Prometheus), the ``/ui`` page and its ``/ui/data``.
"""

from ..serve_args import add_serve_args
from .app import create_app
from .serve import serve_main
from .wire import ApiError
from .worker import Service

__all__ = ["ApiError", "Service", "add_serve_args", "create_app", "serve_main"]
