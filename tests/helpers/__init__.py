"""What the test modules share, one copy each (pytest puts ``tests/`` on the
path, so a test imports ``from helpers.ports import free_port``; a bench puts
``tests/`` on its path and imports the same way). No test is collected here.

* ``agents``: servers over the scripted engine, the agent tests' tools,
  system prompt and a cold server's answer;
* ``cc_loop``: the Claude-Code-shaped agent loop (its bench's too);
* ``checkpoints``: checkpoint names as the store writes them, and the
  damage the tests do to a file (a flipped payload byte);
* ``cold_cache``: cold results (a prefill's reply, logits, state) computed
  once per test process, frozen;
* ``kv``: a text's tokens and a session prefilled cold with it;
* ``metric_samples``: a ``/metrics`` scrape as a dict;
* ``models``: the real models (one shared engine each) and greedy decoding;
* ``page_cache``: how much of a file the page cache holds (``mincore``);
* ``ports``: free TCP ports (``DS4_TEST_PORTS``);
* ``procs``: the ``ds4`` command in a subprocess, and a pid no process has;
* ``redis_servers``: real ``redis-server`` nodes and clusters;
* ``scripted_engine``: the reference engine answering from a script;
* ``server``: a ``ds4 serve`` subprocess (:class:`server.Server`), the
  factory behind conftest's ``serve`` fixtures, and what the server tests
  share (flags, prompts, a cold server's answer, a reply's ``ds4`` block);
* ``together``: calls made in threads started together.

And three scripts a test starts by path as a server process, each
``ds4 serve``'s command line over another engine or store:
``scripted_serve.py`` (the scripted engine), ``cc_serve.py`` (the scripted
engine answering with :func:`cc_loop.script`) and ``fault_serve.py``
(checkpoint writes that fail on a schedule)."""
