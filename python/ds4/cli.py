"""The ``ds4`` command.

::

    ds4 serve  [--host --port --engine --model --ctx --kv-disk-dir ...]   OpenAI-compatible server
    ds4 run    -p TEXT [--max-tokens N] [--raw] [--json] ...                one-shot generation
    ds4 chat   [--system TEXT] [--kv-disk-dir DIR] ...                      interactive REPL
    ds4 kv     ls|show|verify|gc|rm|stats DIR [...] [--json]                inspect a checkpoint directory
    ds4 bench  [--tokens N] [--json]                                        headline figures on this machine

``ds4 kv`` works on ds4-server's own (v1) cache directories too: every file
goes through :func:`ds4.open_checkpoint`, which reads both formats.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TextIO

from . import kvstore as _kvstore
from .kvstore import temp_is_orphaned

__all__ = ["ProgressBar", "main"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------
def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _age(ts: int, now: float | None = None) -> str:
    if not ts:
        return "-"
    d = max(0, int((now or time.time()) - ts))
    for unit, s in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= s:
            return f"{d // s}{unit} ago"
    return f"{d}s ago"


_CTRL = {c: "\ufffd" for c in [*list(range(0, 32)), 127, *list(range(128, 160))] if c not in (9, 10)}


def _printable(s: str) -> str:
    """Terminal-safe text: control characters (except tab and newline) are
    shown as U+FFFD so random model bytes cannot drive the terminal."""
    return s.translate(_CTRL)


def _preview(text: bytes, n: int = 48) -> str:
    s = text.decode("utf-8", "replace").replace("\n", "\\n")
    s = _printable(s)
    return s if len(s) <= n else s[: n - 1] + "…"


def _table(rows: list[list[str]], header: list[str], out: TextIO) -> None:
    cols = [header, *rows]
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(header))]
    for r in cols:
        out.write("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() + "\n")


def _atomic_write_json(path: str, obj) -> None:
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, ensure_ascii=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    from . import _core

    _core.sync_dir(d)


class ProgressBar:
    """A prefill progress bar on stderr, shown once a prefill has run for
    ``delay`` seconds; silent when the stream is not a TTY. ``check`` runs on
    every update (it may raise, e.g. KeyboardInterrupt)."""

    def __init__(
        self,
        label: str = "prefill",
        stream: TextIO | None = None,
        delay: float | None = None,
        check: Callable[[], None] | None = None,
        width: int = 30,
    ):
        if delay is None:  # DS4_PROGRESS_DELAY overrides the 1.5 s (tests set 0)
            try:
                delay = float(os.environ.get("DS4_PROGRESS_DELAY", "1.5"))
            except ValueError:
                delay = 1.5
        self.stream = stream if stream is not None else sys.stderr
        try:
            self.enabled = self.stream.isatty()
        except (AttributeError, ValueError):
            self.enabled = False
        self.label, self.delay, self.check, self.width = label, delay, check, width
        self.t0 = time.perf_counter()
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        if self.check is not None:
            self.check()
        if not self.enabled:
            return
        el = time.perf_counter() - self.t0
        if el < self.delay:
            return
        frac = min(1.0, done / max(1, total))
        fill = int(frac * self.width)
        rate = done / max(el, 1e-9)
        eta = (total - done) / rate if rate > 0 else 0.0
        self.stream.write(
            f"\r\x1b[K{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {done}/{total} tok "
            f"{rate:.0f} tok/s eta {eta:.0f}s"
        )
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.drawn = False


# ---------------------------------------------------------------------------
# ds4 run
# ---------------------------------------------------------------------------
def _engine_and_generator(args, store):
    from .server import Generator, build_engine

    engine = build_engine(args.engine, args.model, args.threads)
    return engine, Generator(engine, args.ctx, store)


def cmd_run(args) -> int:
    from .server import GenParams, check_kv_args, make_store

    msg = check_kv_args(args)
    if msg:
        print(f"ds4 run: {msg}", file=sys.stderr)
        return EXIT_USAGE
    text = args.prompt
    if text == "-":
        text = sys.stdin.read()
    if not text:
        print("ds4 run: the prompt is empty", file=sys.stderr)
        return EXIT_USAGE
    store = make_store(args)
    engine, gen = _engine_and_generator(args, store)
    if args.raw:
        prompt = text
    else:
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": text}
        ]
        prompt = engine.render_chat(msgs)
    params = GenParams(
        max_tokens=args.max_tokens, stop=tuple(args.stop or ()), temperature=args.temperature, seed=args.seed
    )
    bar = ProgressBar()
    streaming = not args.json

    def on_text(s: str) -> None:
        if streaming:
            sys.stdout.write(_printable(s) if sys.stdout.isatty() else s)
            sys.stdout.flush()

    from .errors import ContextOverflowError, EmptyPromptError

    try:
        res = gen.generate(prompt, params, on_text=on_text, progress=bar)
    except (ContextOverflowError, EmptyPromptError) as e:
        bar.close()
        print(f"ds4 run: {e}", file=sys.stderr)
        return EXIT_FAIL
    finally:
        bar.close()
    if args.json:
        out = {
            "text": res.text,
            "tokens": res.tokens,
            "finish_reason": res.finish_reason,
            "usage": res.usage(),
            "timings": {"ttft_s": res.ttft_s, "decode_s": res.decode_s, "total_s": res.total_s},
            "report": res.report.as_dict(),
        }
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        if args.verbose:
            r = res.report
            tps = res.completion_tokens / res.decode_s if res.decode_s > 0 else 0.0
            print(
                f"[rung={r.rung} source={r.source} cached={r.reused_tokens} prompt={res.prompt_tokens} "
                f"gen={res.completion_tokens} finish={res.finish_reason} ttft={res.ttft_s * 1000:.0f} ms {tps:.1f} tok/s]",
                file=sys.stderr,
            )
    return EXIT_OK


# ---------------------------------------------------------------------------
# ds4 chat
# ---------------------------------------------------------------------------
CHAT_INDEX = "ds4-chat.json"
CHAT_LOCK = ".ds4-chat.lock"
DEFAULT_SYSTEM = "You are a helpful assistant."


def write_session(store, sess, reason: str) -> str:
    """Store the live session whatever its length (named and system-prompt
    checkpoints may be shorter than the store's ``min_tokens``)."""
    from .errors import StoreError

    path = store.store_live_prefix(sess, reason, min_tokens=1)
    if path is None:
        raise StoreError(
            f"the store declined to save this session ({reason}): over budget or key held by another engine"
        )
    return path


class ChatREPL:
    """ds4-agent's session handling, on a KVStore:

    * a system-prompt checkpoint (the rendered system prompt alone, named by
      its SHA-1) is loaded on start and on /new when it verifies, else the
      prompt is prefilled and stored;
    * /save NAME stores the live session and records name -> checkpoint and
      the transcript in ``ds4-chat.json`` (written atomically, under a lock);
    * /switch NAME loads that checkpoint (verified) and its transcript, with
      no prefill; a missing or damaged checkpoint falls back to a prefill on
      the next turn;
    * Ctrl+C stops generation at the next token (the session stays valid at
      the tokens evaluated; the partial answer is kept) or, during prefill,
      rolls the turn back (the session is invalidated by the interrupted
      prefill).
    """

    def __init__(
        self,
        gen,
        system: str,
        max_tokens: int,
        out: TextIO = sys.stdout,
        err: TextIO = sys.stderr,
        temperature: float = 0.0,
        seed: int | None = None,
    ):
        self.gen = gen
        self.engine = gen.engine
        self.sess = gen.sess
        self.store = gen.store
        self.system = system
        self.max_tokens = max_tokens
        self.temperature, self.seed = temperature, seed
        self.out, self.err = out, err
        self.messages: list[dict] = []
        self.current: str | None = None
        self._intr = False

    # -- output ----------------------------------------------------------------
    def say(self, msg: str) -> None:
        self.err.write(msg + "\n")
        self.err.flush()

    # -- index -----------------------------------------------------------------
    @property
    def index_path(self) -> str:
        return os.path.join(self.store.dir, CHAT_INDEX)

    def load_index(self) -> dict:
        try:
            with open(self.index_path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            self.say(f"[warning: cannot read {self.index_path}: {e}]")
            return {}
        sessions = data.get("sessions") if isinstance(data, dict) else None
        return sessions if isinstance(sessions, dict) else {}

    @contextlib.contextmanager
    def _index_lock(self):
        fd = os.open(os.path.join(self.store.dir, CHAT_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    # -- system prompt ---------------------------------------------------------
    def reset_to_system(self) -> None:
        from . import _core
        from .checkpoint import open_checkpoint
        from .errors import CheckpointError, CorruptCheckpointError

        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.current = None
        text = self.engine.render_chat(self.messages, add_generation_prompt=False) if self.messages else ""
        if not text:
            self.sess.invalidate("new conversation")
            return
        tb = text.encode("utf-8")
        if self.store is not None:
            path = os.path.join(self.store.dir, _core.sha1_hex(tb) + ".kv")
            t0 = time.perf_counter()
            try:
                ck = open_checkpoint(path, prompt=tb, expected_abi=self.sess.payload_abi, ctx=self.sess.ctx - 1)
                if ck.text != tb:
                    raise FileNotFoundError(path)  # a longer checkpoint cannot be a system prompt
                self.sess.load_checkpoint(ck)
                self.say(
                    f"[system prompt: {ck.tokens} tokens loaded from checkpoint in "
                    f"{(time.perf_counter() - t0) * 1000:.1f} ms]"
                )
                return
            except FileNotFoundError:
                pass
            except CorruptCheckpointError as e:
                self.sess.invalidate("corrupt system prompt checkpoint")
                self.say(f"[system prompt checkpoint rejected ({e.code}); removed]")
                with contextlib.suppress(OSError):
                    os.unlink(path)
            except CheckpointError as e:
                self.sess.invalidate("unusable system prompt checkpoint")
                self.say(f"[system prompt checkpoint unusable ({e.code}); kept]")
            self.say("Updating system prompt cache...")
        self.sess.invalidate("system prompt prefill")
        toks = self.engine.tokenize(text, special=True)
        bar = ProgressBar(check=self._check_intr)
        try:
            self.sess.sync(toks, progress=bar)
        finally:
            bar.close()
        if self.store is not None:
            try:
                write_session(self.store, self.sess, "agent-system")
            except OSError as e:
                self.say(f"[warning: cannot store the system prompt checkpoint: {e}]")

    # -- commands ----------------------------------------------------------------
    def cmd_save(self, name: str) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name or ""):
            self.say("usage: /save NAME (letters, digits, _ . -; at most 64)")
            return
        if not any(m["role"] == "user" for m in self.messages):
            self.say("[nothing to save yet]")
            return
        from . import _core
        from .recovery import recover

        # ds4-agent saves only when the live tokens are the transcript. Make
        # them so: the canonical rendering of the transcript (it differs from
        # the live bytes after an interrupted or lossy, non-UTF-8 answer).
        canonical = self.engine.render_chat(self.messages, add_generation_prompt=False)
        bar = ProgressBar()
        try:
            rep = recover(self.sess, self.store, canonical, evict_save=False, progress=bar)
        finally:
            bar.close()
        if rep.rung != "live":
            self.say(f"[transcript re-synced ({rep.rung}): {rep.prompt_tokens - rep.reused_tokens} tokens prefilled]")
        path = write_session(self.store, self.sess, "named")
        sha = os.path.basename(path)[:-3]
        first_user = next((m["content"] for m in self.messages if m["role"] == "user"), "")
        entry = {
            "sha": sha,
            "tokens": self.sess.n_past,
            "saved": int(time.time()),
            "title": first_user[:60],
            "abi": self.sess.payload_abi,
            "messages": self.messages,
        }
        with self._index_lock():
            sessions = self.load_index()
            sessions[name] = entry
            _atomic_write_json(self.index_path, {"version": 1, "sessions": sessions})
        assert _core.sha1_hex(self.sess.text_bytes()) == sha
        self.current = name
        self.say(f"[saved {name}: {self.sess.n_past} tokens -> {os.path.basename(path)}]")

    def cmd_list(self) -> None:
        sessions = self.load_index()
        if not sessions:
            self.say("[no saved sessions]")
            return
        rows = []
        for name, e in sorted(sessions.items(), key=lambda kv: -int(kv[1].get("saved", 0))):
            path = os.path.join(self.store.dir, f"{e.get('sha', '')}.kv")
            rows.append(
                [
                    "*" if name == self.current else " ",
                    name,
                    str(e.get("tokens", "?")),
                    _age(e.get("saved", 0)),
                    "ok" if os.path.exists(path) else "gone",
                    _printable(str(e.get("title", "")))[:40],
                ]
            )
        import io

        buf = io.StringIO()
        _table(rows, [" ", "NAME", "TOKENS", "SAVED", "FILE", "TITLE"], buf)
        self.err.write(buf.getvalue())
        self.err.flush()

    def cmd_switch(self, name: str) -> None:
        from .checkpoint import open_checkpoint
        from .errors import CheckpointError, CorruptCheckpointError

        sessions = self.load_index()
        e = sessions.get(name)
        if e is None:
            hits = [n for n in sessions if n.startswith(name)] if name else []
            if len(hits) != 1:
                self.say(f"[no saved session {name!r}]" if not hits else f"[ambiguous: {', '.join(sorted(hits))}]")
                return
            name = hits[0]
            e = sessions[name]
        msgs = e.get("messages")
        if not isinstance(msgs, list):
            self.say(f"[index entry {name!r} has no transcript]")
            return
        path = os.path.join(self.store.dir, f"{e.get('sha', '')}.kv")
        rendered = self.engine.render_chat(msgs, add_generation_prompt=False).encode("utf-8")
        t0 = time.perf_counter()
        try:
            ck = open_checkpoint(path, prompt=rendered, expected_abi=self.sess.payload_abi, ctx=self.sess.ctx - 1)
            self.sess.load_checkpoint(ck)
        except FileNotFoundError:
            self.sess.invalidate("switch: checkpoint missing")
            self.say(f"[switched to {name}: checkpoint gone (evicted?); the next turn prefills]")
        except CorruptCheckpointError as ex:
            self.sess.invalidate("switch: corrupt checkpoint")
            with contextlib.suppress(OSError):
                os.unlink(path)
            self.say(
                f"[switched to {name}: checkpoint rejected ({ex.stage}/{ex.code}) and removed; the next turn prefills]"
            )
        except CheckpointError as ex:
            self.sess.invalidate("switch: unusable checkpoint")
            self.say(f"[switched to {name}: checkpoint unusable ({ex.code}); the next turn prefills]")
        else:
            ms = (time.perf_counter() - t0) * 1000
            self.say(f"[switched to {name}: {ck.tokens} tokens loaded from disk in {ms:.1f} ms, no prefill]")
        self.messages = [dict(m) for m in msgs]
        self.current = name

    def cmd_clear(self) -> None:
        self.sess.invalidate("/clear")
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.current = None
        self.say("[history cleared; session invalidated]")

    # -- a turn ------------------------------------------------------------------
    def _check_intr(self) -> None:
        if self._intr:
            raise KeyboardInterrupt

    def _on_sigint(self, signum, frame) -> None:
        self._intr = True

    def turn(self, user_text: str) -> None:
        from .errors import ContextOverflowError, EngineError
        from .server import GenParams

        self.messages.append({"role": "user", "content": user_text})
        prompt = self.engine.render_chat(self.messages)
        params = GenParams(max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed)
        self._intr = False
        bar = ProgressBar(check=self._check_intr)
        started = [False]

        def on_start(rep):
            bar.close()
            started[0] = True

        def on_text(s: str) -> None:
            self.out.write(_printable(s))
            self.out.flush()

        old = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            res = self.gen.generate(
                prompt, params, on_start=on_start, on_text=on_text, cancel=lambda: self._intr, progress=bar
            )
        except KeyboardInterrupt:
            bar.close()
            self.messages.pop()
            self.say(
                f"\n[interrupted during prefill; turn rolled back; session "
                f"{'valid' if self.sess.checkpoint_valid else 'invalidated'}]"
            )
            return
        except ContextOverflowError as e:
            bar.close()
            self.messages.pop()
            self.say(f"[{e}; use /new or /clear]")
            return
        except EngineError as e:
            bar.close()
            self.messages.pop()
            self.say(f"[engine error: {e}; turn rolled back, session invalidated]")
            return
        finally:
            signal.signal(signal.SIGINT, old)
        self.out.write("\n")
        self.out.flush()
        if res.finish_reason == "cancelled" and not res.tokens:
            self.messages.pop()
            self.say("[interrupted before the first token; turn rolled back]")
            return
        self.messages.append({"role": "assistant", "content": res.text})
        r = res.report
        tps = res.completion_tokens / res.decode_s if res.decode_s > 0 else 0.0
        extra = " (interrupted)" if res.finish_reason == "cancelled" else ""
        self.say(
            f"[{r.rung}/{r.source} cached={r.reused_tokens} prompt={res.prompt_tokens} gen={res.completion_tokens}"
            f"{extra} ttft={res.ttft_s * 1000:.0f} ms {tps:.0f} tok/s]"
        )

    # -- the loop ----------------------------------------------------------------
    HELP = (
        "commands: /save NAME  /list  /switch NAME  /new  /clear  /quit\nCtrl+C stops generation; Ctrl+D or /quit exits"
    )

    def handle(self, line: str) -> bool:
        """Run one input line; False means quit."""
        line = line.strip()
        if not line:
            return True
        if line.startswith("/"):
            cmd, _, arg = line.partition(" ")
            arg = arg.strip()
            if cmd in ("/quit", "/exit"):
                return False
            if cmd == "/help":
                self.say(self.HELP)
            elif cmd == "/clear":
                self.cmd_clear()
            elif cmd == "/new":
                self.reset_to_system()
                self.say("[new conversation]")
            elif cmd in ("/save", "/list", "/switch") and self.store is None:
                self.say("[no checkpoint directory: start with --kv-disk-dir]")
            elif cmd == "/save":
                self.cmd_save(arg)
            elif cmd == "/list":
                self.cmd_list()
            elif cmd == "/switch":
                self.cmd_switch(arg)
            else:
                self.say(f"[unknown command {cmd}; /help]")
            return True
        self.turn(line)
        return True

    def loop(self, stdin: TextIO = sys.stdin) -> int:
        interactive = stdin.isatty()
        if interactive:
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401  (line editing for input())
        self.say(
            f"ds4 chat: {self.engine.name} ctx={self.sess.ctx} kv={self.store.dir if self.store else 'off'}; /help"
        )
        self.reset_to_system()
        while True:
            try:
                if interactive:
                    line = input(">>> ")
                else:
                    line = stdin.readline()
                    if not line:
                        break
            except EOFError:
                self.out.write("\n")
                break
            except KeyboardInterrupt:
                self.out.write("^C (use /quit to exit)\n")
                continue
            if not self.handle(line):
                break
        return EXIT_OK


def cmd_chat(args) -> int:
    from .server import check_kv_args, make_store

    msg = check_kv_args(args)
    if msg:
        print(f"ds4 chat: {msg}", file=sys.stderr)
        return EXIT_USAGE
    store = make_store(args)
    _engine, gen = _engine_and_generator(args, store)
    repl = ChatREPL(gen, args.system, args.max_tokens, temperature=args.temperature, seed=args.seed)
    return repl.loop()


# ---------------------------------------------------------------------------
# ds4 kv
# ---------------------------------------------------------------------------
_SHA_NAME = re.compile(r"^[0-9a-f]{40}\.kv$")
# temp names (ours, ds4-server's, ds4-agent's) are defined once, in kvstore
_TMP_NAME = _kvstore._TMP_RE


def _scan(d: str) -> tuple[list[str], list[str], list[str]]:
    """(checkpoint files, temp files, other .kv files) in directory ``d``."""
    cks, tmps, other = [], [], []
    with os.scandir(d) as it:
        for de in it:
            if _SHA_NAME.match(de.name):
                cks.append(de.path)
            elif _TMP_NAME.match(de.name):
                tmps.append(de.path)
            elif de.name.endswith(".kv"):
                other.append(de.path)
    return sorted(cks), sorted(tmps), sorted(other)


def inspect_file(path: str, full: bool = False) -> dict:
    """Facts about one checkpoint file; ``full`` runs the whole pipeline
    (payload checksum for v2, DSV4 decode for v1)."""
    from .checkpoint import open_checkpoint
    from .errors import CheckpointError

    info: dict = {"name": os.path.basename(path), "path": path}
    try:
        st = os.stat(path, follow_symlinks=False)
        info["size"] = st.st_size
    except OSError as e:
        info.update(status="error", error={"stage": "open", "code": "os_error", "reason": str(e)})
        return info
    try:
        ck = open_checkpoint(path, load_payload=full, verify_checksum=full, mmap=False)
    except CheckpointError as e:
        info.update(status=e.kind, error={"stage": e.stage, "code": e.code, "reason": e.reason})
        return info
    except OSError as e:
        info.update(status="error", error={"stage": "open", "code": "os_error", "reason": str(e)})
        return info
    info.update(
        status="ok",
        version=ck.version,
        reason=ck.reason_name,
        tokens=ck.tokens,
        text_bytes=ck.text_bytes,
        hits=ck.hits,
        ctx=ck.ctx,
        quant_bits=ck.quant_bits,
        flags=ck.flags,
        created=ck.created,
        last_used=ck.last_used,
        payload_bytes=ck.payload_bytes,
        trailer_bytes=ck.trailer_bytes,
        abi=ck.abi if ck.version >= 2 else "ds4 v1 (DSV4 payload)",
        preview=_preview(ck.text),
    )
    if ck.version >= 2:
        info["tensors"] = [
            {"name": n, "dtype": dt, "shape": list(sh), "offset": off, "bytes": nb}
            for (n, dt, sh, off, nb) in ck.tensor_table()
        ]
        info["payload_checksum"] = f"{ck.payload_checksum:016x}"
        info["header_checksum"] = f"{ck.header_checksum:016x}"
    else:
        info["dsv4"] = dict(ck.dsv4) if ck.dsv4 else None
    info["_text"] = ck.text
    return info


def _public(info: dict) -> dict:
    return {k: v for k, v in info.items() if not k.startswith("_")}


def _resolve(d: str, name: str) -> tuple[str | None, str | None]:
    """A checkpoint path in ``d`` by file name or unique hex prefix."""
    if os.sep in name and os.path.exists(name):
        return name, None
    cands = [p for p in _scan(d)[0] + _scan(d)[2] if os.path.basename(p) == name or os.path.basename(p) == name + ".kv"]
    if cands:
        return cands[0], None
    hits = [p for p in _scan(d)[0] if os.path.basename(p).startswith(name.lower())] if name else []
    if len(hits) == 1:
        return hits[0], None
    return None, ("no checkpoint matches" if not hits else f"ambiguous ({len(hits)} files match)") + f" {name!r}"


def _not_a_dir(d: str) -> bool:
    """True (after saying so on stderr) when ``d`` is not a directory."""
    if os.path.isdir(d):
        return False
    print(f"ds4 kv: {d}: not a directory", file=sys.stderr)
    return True


def kv_ls(args) -> int:
    d = args.dir
    if _not_a_dir(d):
        return EXIT_USAGE
    cks, tmps, other = _scan(d)
    infos = [inspect_file(p) for p in cks + other]
    infos.sort(key=lambda i: (-(i.get("last_used") or 0), i["name"]))
    if args.json:
        print(
            json.dumps(
                {
                    "dir": os.path.abspath(d),
                    "files": [_public(i) for i in infos],
                    "temp_files": [os.path.basename(t) for t in tmps],
                },
                indent=1,
            )
        )
        return EXIT_OK
    now = time.time()
    rows = []
    for i in infos:
        if i["status"] == "ok":
            rows.append(
                [
                    i["name"][:12],
                    f"v{i['version']}",
                    i["reason"],
                    str(i["tokens"]),
                    _human_bytes(i["size"]),
                    str(i["hits"]),
                    _age(i["last_used"] or i["created"], now),
                    "ok",
                    i["preview"],
                ]
            )
        else:
            err = i["error"]
            rows.append(
                [
                    i["name"][:12],
                    "?",
                    "?",
                    "?",
                    _human_bytes(i.get("size", 0)),
                    "?",
                    "?",
                    f"{i['status']}:{err['code']}",
                    _printable(err["reason"])[:48],
                ]
            )
    _table(rows, ["NAME", "VER", "REASON", "TOKENS", "SIZE", "HITS", "LAST USED", "STATUS", "TEXT"], sys.stdout)
    total = sum(i.get("size", 0) for i in infos)
    print(f"{len(infos)} files, {_human_bytes(total)}" + (f", {len(tmps)} temp files" if tmps else ""))
    return EXIT_OK


def kv_show(args) -> int:
    d = args.dir
    if os.path.isfile(d) and not args.name:
        path, why = d, None
    else:
        if _not_a_dir(d):
            return EXIT_USAGE
        if not args.name:
            print("ds4 kv show: give a checkpoint name (or a unique prefix)", file=sys.stderr)
            return EXIT_USAGE
        path, why = _resolve(d, args.name)
    if path is None:
        print(f"ds4 kv show: {why}", file=sys.stderr)
        return EXIT_FAIL
    info = inspect_file(path, full=args.verify)
    text = info.pop("_text", None)
    if args.json:
        out = _public(info)
        if text is not None:
            out["text"] = text.decode("utf-8", "replace")
        print(json.dumps(out, indent=1, ensure_ascii=False))
        return EXIT_OK if info["status"] == "ok" else EXIT_FAIL
    for k in (
        "name",
        "path",
        "status",
        "version",
        "reason",
        "tokens",
        "text_bytes",
        "size",
        "hits",
        "ctx",
        "quant_bits",
        "flags",
        "created",
        "last_used",
        "payload_bytes",
        "trailer_bytes",
        "abi",
        "header_checksum",
        "payload_checksum",
    ):
        if k in info:
            v = info[k]
            if k in ("created", "last_used") and v:
                v = f"{v} ({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(v))}, {_age(v)})"
            elif k == "size":
                v = f"{v} ({_human_bytes(v)})"
            print(f"{k:16} {v}")
    if info.get("error"):
        er = info["error"]
        print(f"{'error':16} {er['stage']}/{er['code']}: {er['reason']}")
    if info.get("dsv4"):
        print("DSV4 payload header:")
        for k, v in info["dsv4"].items():
            print(f"  {k:14} {hex(v) if k == 'magic' else v}")
    if info.get("tensors"):
        print("tensors:")
        _table(
            [
                [
                    "  " + t["name"],
                    t["dtype"],
                    "x".join(map(str, t["shape"])) or "()",
                    str(t["offset"]),
                    _human_bytes(t["bytes"]),
                ]
                for t in info["tensors"]
            ],
            ["  NAME", "DTYPE", "SHAPE", "OFFSET", "BYTES"],
            sys.stdout,
        )
    if text is not None:
        s = text.decode("utf-8", "replace")
        if not args.text and len(s) > 400:
            s = s[:200] + f"\n… ({len(text)} bytes; --text shows all) …\n" + s[-200:]
        print("text:")
        print(_printable(s))
    return EXIT_OK if info["status"] == "ok" else EXIT_FAIL


def kv_verify(args) -> int:
    d = args.dir
    if _not_a_dir(d):
        return EXIT_USAGE
    if args.names:
        paths = []
        for n in args.names:
            p, why = _resolve(d, n)
            if p is None:
                print(f"ds4 kv verify: {why}", file=sys.stderr)
                return EXIT_FAIL
            paths.append(p)
    else:
        cks, _, other = _scan(d)
        paths = cks + other
    t0 = time.perf_counter()
    results = []
    for p in paths:
        i = inspect_file(p, full=True)
        results.append(
            {
                "name": i["name"],
                "ok": i["status"] == "ok",
                "version": i.get("version"),
                "tokens": i.get("tokens"),
                "size": i.get("size"),
                **({"status": i["status"], **i["error"]} if i["status"] != "ok" else {}),
            }
        )
    bad = [r for r in results if not r["ok"]]
    secs = time.perf_counter() - t0
    if args.json:
        print(
            json.dumps(
                {
                    "dir": os.path.abspath(d),
                    "files": results,
                    "ok": len(results) - len(bad),
                    "failed": len(bad),
                    "seconds": secs,
                },
                indent=1,
            )
        )
    else:
        for r in results:
            if r["ok"]:
                print(f"OK    {r['name']}  v{r['version']} tokens={r['tokens']} {_human_bytes(r['size'] or 0)}")
            else:
                print(f"FAIL  {r['name']}  {r['status']} {r['stage']}/{r['code']}: {r['reason']}")
        print(f"{len(results) - len(bad)} ok, {len(bad)} failed ({secs:.2f} s)")
    return EXIT_FAIL if bad else EXIT_OK


def kv_gc(args) -> int:
    from . import _core

    d = args.dir
    if _not_a_dir(d):
        return EXIT_USAGE
    cks, tmps, _ = _scan(d)
    before = sum(os.path.getsize(p) for p in cks if os.path.exists(p))
    removed, quarantined, tmp_removed, evicted, kept = [], [], [], [], []
    now = time.time()
    for p in cks:
        i = inspect_file(p, full=True)
        if i["status"] == "corrupt":
            if not args.dry_run:
                try:
                    if args.quarantine_dir:
                        os.makedirs(args.quarantine_dir, mode=0o700, exist_ok=True)
                        os.replace(p, os.path.join(args.quarantine_dir, f"{i['name']}.{int(now)}.{i['error']['code']}"))
                        quarantined.append(i["name"])
                    else:
                        os.unlink(p)
                except FileNotFoundError:
                    continue
            removed.append({"name": i["name"], **i["error"]})
        elif i["status"] != "ok":
            kept.append({"name": i["name"], "status": i["status"], **i["error"]})
    for t in tmps:
        name = os.path.basename(t)
        try:
            age = now - os.stat(t, follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        if temp_is_orphaned(name, now - age, now, args.tmp_age):
            if not args.dry_run:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(t)
            tmp_removed.append(name)
    if (removed or tmp_removed) and not args.dry_run:
        _core.sync_dir(d)
    if args.budget_mb is not None:
        if args.dry_run:
            evicted = _simulate_evict(d, args.budget_mb)  # the store's policy, without unlinking
        else:
            from .kvstore import KVStore

            names_before = set(os.path.basename(p) for p in _scan(d)[0])
            store = KVStore(d, budget_mb=args.budget_mb, min_tokens=1)
            store.evict()
            evicted = sorted(names_before - set(os.path.basename(p) for p in _scan(d)[0]))
    after = sum(os.path.getsize(p) for p in _scan(d)[0] if os.path.exists(p))
    out = {
        "dir": os.path.abspath(d),
        "dry_run": args.dry_run,
        "removed_corrupt": removed,
        "quarantined": quarantined,
        "removed_temp": tmp_removed,
        "evicted": evicted,
        "kept_unusable": kept,
        "bytes_before": before,
        "bytes_after": after,
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    for r in removed:
        print(f"{verb} corrupt {r['name']}: {r['stage']}/{r['code']}: {r['reason']}")
    for t in tmp_removed:
        print(f"{verb} orphaned temp file {t}")
    for n in evicted:
        print(f"{'would evict' if args.dry_run else 'evicted'} {n}")
    for k in kept:
        print(f"kept {k['name']} ({k['status']}: {k['code']})")
    print(
        f"{len(removed)} corrupt, {len(tmp_removed)} temp, {len(evicted)} evicted; "
        f"{_human_bytes(before)} -> {_human_bytes(after)}"
    )
    return EXIT_OK


def _simulate_evict(d: str, budget_mb: float) -> list[str]:
    from .kvstore import Entry, plan_eviction

    ents = []
    for p in _scan(d)[0]:
        i = inspect_file(p)
        if i["status"] == "ok":
            ents.append(
                Entry(
                    i["name"],
                    p,
                    i["version"],
                    i["tokens"],
                    i["text_bytes"],
                    i["hits"],
                    i["created"],
                    i["last_used"],
                    i["size"],
                    i["abi"],
                    i["reason"],
                    i["ctx"],
                    (),
                )
            )
    return [e.name for e in plan_eviction(ents, int(budget_mb * 1024 * 1024), time.time())]


def kv_rm(args) -> int:
    from . import _core

    d = args.dir
    if _not_a_dir(d):
        return EXIT_USAGE
    if args.all:
        targets, errors = _scan(d)[0], []
    else:
        if not args.names:
            print("ds4 kv rm: give checkpoint names (or unique prefixes), or --all", file=sys.stderr)
            return EXIT_USAGE
        targets, errors = [], []
        for n in args.names:
            p, why = _resolve(d, n)
            if p is None:
                errors.append(why)
            else:
                targets.append(p)
    removed = []
    for p in targets:
        try:
            os.unlink(p)
            removed.append(os.path.basename(p))
        except FileNotFoundError:
            errors.append(f"{os.path.basename(p)}: already gone")
    if removed:
        _core.sync_dir(d)
    if args.json:
        print(json.dumps({"removed": removed, "errors": errors}, indent=1))
    else:
        for n in removed:
            print(f"removed {n}")
        for er in errors:
            print(f"ds4 kv rm: {er}", file=sys.stderr)
    return EXIT_FAIL if errors else EXIT_OK


def kv_stats(args) -> int:
    d = args.dir
    if _not_a_dir(d):
        return EXIT_USAGE
    cks, tmps, other = _scan(d)
    infos = [inspect_file(p) for p in cks + other]
    ok = [i for i in infos if i["status"] == "ok"]
    by = lambda key: {k: sum(1 for i in ok if str(i[key]) == k) for k in sorted({str(i[key]) for i in ok})}  # noqa: E731
    st = {
        "dir": os.path.abspath(d),
        "files": len(infos),
        "ok": len(ok),
        "unusable": {
            s: sum(1 for i in infos if i["status"] == s)
            for s in sorted({i["status"] for i in infos if i["status"] != "ok"})
        },
        "bytes": sum(i.get("size", 0) for i in infos),
        "tokens": sum(i["tokens"] for i in ok),
        "by_version": by("version"),
        "by_reason": by("reason"),
        "by_abi": by("abi"),
        "hits": sum(i["hits"] for i in ok),
        "oldest_created": min((i["created"] for i in ok if i["created"]), default=None),
        "newest_used": max((i["last_used"] or i["created"] for i in ok), default=None),
        "temp_files": len(tmps),
        "temp_bytes": sum(os.path.getsize(t) for t in tmps if os.path.exists(t)),
    }
    if args.json:
        print(json.dumps(st, indent=1))
        return EXIT_OK
    print(f"directory      {st['dir']}")
    print(
        f"files          {st['files']} ({st['ok']} ok" + "".join(f", {n} {s}" for s, n in st["unusable"].items()) + ")"
    )
    print(f"size           {_human_bytes(st['bytes'])}")
    print(f"tokens         {st['tokens']}")
    print(f"hits           {st['hits']}")
    print("versions       " + ", ".join(f"v{k}: {n}" for k, n in st["by_version"].items()))
    print("reasons        " + ", ".join(f"{k}: {n}" for k, n in st["by_reason"].items()))
    for abi, n in st["by_abi"].items():
        print(f"abi            {n} x {abi}")
    if st["newest_used"]:
        print(f"last used      {_age(st['newest_used'])}")
    print(f"temp files     {st['temp_files']} ({_human_bytes(st['temp_bytes'])})")
    return EXIT_OK


# ---------------------------------------------------------------------------
# ds4 bench
# ---------------------------------------------------------------------------
def cmd_bench(args) -> int:
    import numpy as np

    import ds4

    from . import _core
    from .checkpoint import open_checkpoint

    rows: list[tuple[str, float, str]] = []
    eng = ds4.ReferenceEngine()
    ctx = max(8192, args.tokens * 2)
    body = "The quick brown fox jumps over the lazy dog. " * (args.tokens // 40 + 2)
    msgs = [{"role": "system", "content": "You are a benchmark."}, {"role": "user", "content": body}]
    prompt = eng.render_chat(msgs)
    toks = eng.tokenize(prompt, special=True)
    while len(toks) > args.tokens:
        body = body[: len(body) - (len(toks) - args.tokens)]
        msgs[1]["content"] = body
        prompt = eng.render_chat(msgs)
        toks = eng.tokenize(prompt, special=True)
    n = len(toks)
    follow = prompt + "Sure.<|im_end|>\n<|im_start|>user\nAnd in one word?<|im_end|>\n<|im_start|>assistant\n"
    with tempfile.TemporaryDirectory(prefix="ds4-bench-") as tmp:
        d = args.kv_disk_dir or tmp
        store = ds4.KVStore(d, budget_mb=4096, min_tokens=16)
        ds4.Session(eng, ctx=ctx).sync(toks[:512])  # warm-up: first-call allocations and tables
        # cold: full prefill then the first token
        s = ds4.Session(eng, ctx=ctx)
        t0 = time.perf_counter()
        s.sync(toks)
        s.argmax()
        cold = time.perf_counter() - t0
        rows.append((f"TTFT cold ({n} tokens, full prefill)", cold * 1000, "ms"))
        t0 = time.perf_counter()
        path = store.store_live_prefix(s, "cold")
        save = time.perf_counter() - t0
        size = os.path.getsize(path)
        rows.append((f"checkpoint save ({_human_bytes(size)}, fsync)", save * 1000, "ms"))
        t0 = time.perf_counter()
        ck = open_checkpoint(path, prompt=prompt, expected_abi=s.payload_abi, ctx=ctx - 1)
        s2 = ds4.Session(eng, ctx=ctx)
        s2.load_checkpoint(ck)
        load = time.perf_counter() - t0
        rows.append(("checkpoint verify + load", load * 1000, "ms"))
        # resumed: a new process would start with an empty session
        s3 = ds4.Session(eng, ctx=ctx)
        t0 = time.perf_counter()
        rep = ds4.recover(s3, store, follow)
        s3.argmax()
        resumed = time.perf_counter() - t0
        rows.append(
            (
                f"TTFT resumed from disk (+{rep.prompt_tokens - rep.reused_tokens} new tokens, rung={rep.rung})",
                resumed * 1000,
                "ms",
            )
        )
        s4 = ds4.Session(eng, ctx=ctx)
        t0 = time.perf_counter()
        s4.sync(eng.tokenize(follow, special=True))
        s4.argmax()
        cold2 = time.perf_counter() - t0
        rows.append(("TTFT same follow-up, cold", cold2 * 1000, "ms"))
        rows.append(("speed-up resumed vs cold", cold2 / max(resumed, 1e-9), "x"))
        del ck, s2
    # SHA-1
    data = np.random.default_rng(0).integers(0, 256, size=args.sha_mb << 20, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    a = _core.sha1_hex(data)
    t_core = time.perf_counter() - t0
    t0 = time.perf_counter()
    b = hashlib.sha1(data).hexdigest()
    t_lib = time.perf_counter() - t0
    assert a == b
    mb = len(data) / 2**20
    rows.append(("SHA-1 ds4 core", mb / t_core, "MiB/s"))
    rows.append(("SHA-1 hashlib", mb / t_lib, "MiB/s"))
    pb = data[: 1 << 20]
    lengths = sorted(set(int(x) for x in np.linspace(1024, len(pb), 64)))
    t0 = time.perf_counter()
    _core.sha1_prefixes(pb, lengths)
    t_one = time.perf_counter() - t0
    t0 = time.perf_counter()
    for L in lengths:
        hashlib.sha1(pb[:L]).digest()
    t_each = time.perf_counter() - t0
    rows.append((f"prefix lookup, {len(lengths)} candidates in 1 MiB: one pass", t_one * 1000, "ms"))
    rows.append((f"prefix lookup, {len(lengths)} candidates in 1 MiB: hashlib each", t_each * 1000, "ms"))
    if args.json:
        print(json.dumps([{"name": r[0], "value": r[1], "unit": r[2]} for r in rows], indent=1))
        return EXIT_OK
    w = max(len(r[0]) for r in rows)
    print(f"{'measure'.ljust(w)}  {'value':>10}  unit")
    for name, v, unit in rows:
        print(f"{name.ljust(w)}  {v:10.2f}  {unit}")
    return EXIT_OK


# ---------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from .server import add_engine_args, add_kv_args, add_serve_args

    p = argparse.ArgumentParser(prog="ds4", description="ds4: LLM inference with a verified disk KV cache")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    sp = sub.add_parser("serve", help="OpenAI-compatible HTTP server (one live session, disk KV cache)")
    add_serve_args(sp)

    def gen_args(q, max_tokens: int):
        q.add_argument(
            "--max-tokens", type=int, default=max_tokens, metavar="N", help=f"tokens to generate (default {max_tokens})"
        )
        q.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
        q.add_argument("--seed", type=int, default=None, help="sampling seed")

    rp = sub.add_parser("run", help="generate once from a prompt")
    rp.add_argument("-p", "--prompt", required=True, help="the prompt ('-' reads stdin)")
    rp.add_argument("--raw", action="store_true", help="use the prompt as is (no chat template)")
    rp.add_argument("--system", default=None, help="a system message (chat mode)")
    rp.add_argument("--stop", action="append", metavar="TEXT", help="stop sequence (repeatable)")
    rp.add_argument("--json", action="store_true", help="print {text, tokens, report, ...} as JSON")
    rp.add_argument("-v", "--verbose", action="store_true", help="print the ladder report to stderr")
    gen_args(rp, 128)
    add_engine_args(rp)
    add_kv_args(rp)

    cp = sub.add_parser("chat", help="interactive chat with named checkpoints (/save /list /switch /new /clear /quit)")
    cp.add_argument("--system", default=DEFAULT_SYSTEM, help="system prompt (its checkpoint is reused across sessions)")
    cp.add_argument("--no-kv-cache", action="store_true", help="no checkpoint directory")
    gen_args(cp, 512)
    add_engine_args(cp)
    add_kv_args(cp, dir_default=os.environ.get("DS4_KV_DIR") or os.path.join("~", ".cache", "ds4", "kv"))

    kp = sub.add_parser("kv", help="inspect a checkpoint directory (ds4 v1 and v2 files)")
    ksub = kp.add_subparsers(dest="kvcmd", metavar="ACTION")
    k = ksub.add_parser("ls", help="list checkpoints")
    k.add_argument("dir")
    k.add_argument("--json", action="store_true")
    k = ksub.add_parser("show", help="one checkpoint's header, tensors and text")
    k.add_argument("dir", help="directory (or a checkpoint file)")
    k.add_argument("name", nargs="?", help="file name or unique hex prefix")
    k.add_argument("--text", action="store_true", help="print the whole text")
    k.add_argument("--verify", action="store_true", help="run the full verification too")
    k.add_argument("--json", action="store_true")
    k = ksub.add_parser("verify", help="run the full verification pipeline on every file (exit 1 on any failure)")
    k.add_argument("dir")
    k.add_argument("names", nargs="*", help="only these files (names or unique prefixes)")
    k.add_argument("--json", action="store_true")
    k = ksub.add_parser("gc", help="remove corrupt and orphaned temp files; evict to a budget")
    k.add_argument("dir")
    k.add_argument("--budget-mb", type=float, default=None, help="evict (ds4's score) until the directory fits")
    k.add_argument(
        "--tmp-age", type=float, default=3600, help="temp files older than this (s) are orphans (default 3600)"
    )
    k.add_argument("--quarantine-dir", default=None, help="move corrupt files here instead of deleting")
    k.add_argument("--dry-run", action="store_true")
    k.add_argument("--json", action="store_true")
    k = ksub.add_parser("rm", help="remove checkpoints")
    k.add_argument("dir")
    k.add_argument("names", nargs="*", help="file names or unique hex prefixes")
    k.add_argument("--all", action="store_true", help="every checkpoint in the directory")
    k.add_argument("--json", action="store_true")
    k = ksub.add_parser("stats", help="totals by version, reason and ABI")
    k.add_argument("dir")
    k.add_argument("--json", action="store_true")

    bp = sub.add_parser("bench", help="headline figures on this machine (reference engine)")
    bp.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096)")
    bp.add_argument("--sha-mb", type=int, default=64, help="MiB hashed for the SHA-1 figures (default 64)")
    bp.add_argument("--kv-disk-dir", default=None, help="directory for the checkpoint (default: a temp dir)")
    bp.add_argument("--json", action="store_true")

    dp = sub.add_parser(
        "demo", help="the end-to-end demo: cold prefill + save, restart + resume, corruption + recovery", add_help=False
    )
    dp.add_argument("demo_args", nargs=argparse.REMAINDER)
    return p


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # its own argument parser (python -m ds4.demo)
        from .demo import main as demo_main

        return demo_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from . import __version__

        print(f"ds4 {__version__}")
        return EXIT_OK
    if args.cmd is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        if args.cmd == "serve":
            from .server import serve_main

            return serve_main(args)
        if args.cmd == "run":
            return cmd_run(args)
        if args.cmd == "chat":
            return cmd_chat(args)
        if args.cmd == "bench":
            return cmd_bench(args)
        if args.cmd == "kv":
            fn = {"ls": kv_ls, "show": kv_show, "verify": kv_verify, "gc": kv_gc, "rm": kv_rm, "stats": kv_stats}.get(
                args.kvcmd
            )
            if fn is None:
                parser.parse_args(["kv", "--help"])
                return EXIT_USAGE
            return fn(args)
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")
        return EXIT_OK
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except Exception as e:  # engine construction and the like: one line, not a traceback
        from .errors import Ds4Error

        if isinstance(e, (Ds4Error, ValueError, OSError)):
            print(f"ds4 {args.cmd}: {e}", file=sys.stderr)
            return EXIT_FAIL
        raise
    return EXIT_USAGE
