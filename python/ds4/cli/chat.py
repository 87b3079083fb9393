"""``ds4 chat``: an interactive REPL with named checkpoints, ds4-agent's
session handling on a :class:`ds4.KVStore`."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import signal
import sys
import time
from types import FrameType
from typing import Any, TextIO

from .. import _core
from ..config import build_engine, check_kv_args, make_store
from ..durable import write_durably
from ..errors import ContextOverflowError, EngineError, StoreError
from ..keytext import tokenize_prompt
from ..kvstore import KVStore, is_checkpoint_name
from ..kvstore.files import legacy_name
from ..loading import load_named
from ..recovery import RecoveryReport, recover
from ..session import Session
from ..turn import GenParams, TurnDriver
from .progress import ProgressBar
from .term import EXIT_OK, EXIT_USAGE, age, printable, table

__all__ = ["CHAT_INDEX", "ChatREPL", "cmd_chat", "write_session"]

CHAT_INDEX = "ds4-chat.json"


def atomic_write_json(path: str, obj: object) -> None:
    """Write ``obj`` as JSON durably: temp file, fsync, rename, fsync dir."""
    write_durably(os.path.abspath(path), json.dumps(obj, indent=1, ensure_ascii=False).encode("utf-8"), sync_dir=True)


def write_session(store: KVStore, sess: Session, reason: str) -> str:
    """Store the live session whatever its length (named and system-prompt
    checkpoints may be shorter than the store's ``min_tokens``)."""
    got = store.store_live_checked(sess, reason, min_tokens=1)
    if not isinstance(got, str):
        raise StoreError(f"the store declined to save this session ({reason}): {got.code} ({got.detail})")
    return got


class ChatREPL:
    """ds4-agent's session handling, on a KVStore:

    * a system-prompt checkpoint (the rendered system prompt alone, named by
      its SHA-1) is loaded on start and on /new when it verifies, else the
      prompt is prefilled and stored;
    * /save NAME stores the live session and records name -> checkpoint and
      the transcript in ``ds4-chat.json`` (written atomically, under the
      store's lock);
    * /switch NAME loads that checkpoint (verified) and its transcript, with
      no prefill; a missing or damaged checkpoint falls back to a prefill on
      the next turn;
    * Ctrl+C stops generation at the next token (the session stays valid at
      the tokens evaluated; the partial answer is kept) or, during prefill,
      rolls the turn back (the session is invalidated by the interrupted
      prefill).

    Checkpoints are found, loaded and discarded by the store alone.
    """

    def __init__(
        self,
        gen: TurnDriver,
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
        self.messages: list[dict[str, str]] = []
        self.current: str | None = None
        self._intr = False

    # -- output ----------------------------------------------------------------
    def say(self, msg: str) -> None:
        self.err.write(msg + "\n")
        self.err.flush()

    # -- index -----------------------------------------------------------------
    def _store(self) -> KVStore:
        assert self.store is not None  # the commands that need it check first
        return self.store

    @property
    def index_path(self) -> str:
        return os.path.join(self._store().dir, CHAT_INDEX)

    def load_index(self) -> dict[str, Any]:
        try:
            # never through a symlink: the index is this directory's own file
            fd = os.open(self.index_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            with open(fd, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            self.say(f"[warning: cannot read {self.index_path}: {e}]")
            return {}
        sessions = data.get("sessions") if isinstance(data, dict) else None
        return sessions if isinstance(sessions, dict) else {}

    # -- system prompt ---------------------------------------------------------
    def reset_to_system(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.current = None
        text = self.engine.render_chat(self.messages, add_generation_prompt=False) if self.messages else ""
        if not text:
            self.sess.invalidate("new conversation")
            return
        toks = tokenize_prompt(self.engine, text)
        if self.store is not None:
            tb = self.sess.key_of(toks)  # the key text (ds4.keytext): what the checkpoint is named after
            r = load_named(self.store, self.sess, _core.sha1_hex(tb), tb, exact=True)
            if r.status == "loaded":
                self.say(f"[system prompt: {r.tokens} tokens loaded from checkpoint in {r.ms:.1f} ms]")
                return
            if r.status == "corrupt" and r.error is not None:
                self.say(f"[system prompt checkpoint rejected ({r.error.code}); removed]")
            elif r.status == "unusable" and r.error is not None:
                self.say(f"[system prompt checkpoint unusable ({r.error.code}); kept]")
            self.say("Updating system prompt cache...")
        self.sess.invalidate("system prompt prefill")
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
        store = self._store()
        # ds4-agent saves only when the live tokens are the transcript. Make
        # them so: the canonical rendering of the transcript (it differs from
        # the live bytes after an interrupted or lossy, non-UTF-8 answer).
        canonical = self.engine.render_chat(self.messages, add_generation_prompt=False)
        bar = ProgressBar()
        try:
            rep = recover(self.sess, store, canonical, evict_save=False, progress=bar)
        finally:
            bar.close()
        if rep.rung != "live":
            self.say(f"[transcript re-synced ({rep.rung}): {rep.prompt_tokens - rep.reused_tokens} tokens prefilled]")
        path = write_session(store, self.sess, "named")
        sha = os.path.basename(path)[:40]  # <sha>.kv or <sha>-<model tag>.kv
        first_user = next((m["content"] for m in self.messages if m["role"] == "user"), "")
        entry = {
            "sha": sha,
            "tokens": self.sess.n_past,
            "saved": int(time.time()),
            "title": first_user[:60],
            "abi": self.sess.payload_abi,
            "messages": self.messages,
        }
        with store.locked():
            sessions = self.load_index()
            sessions[name] = entry
            atomic_write_json(self.index_path, {"version": 1, "sessions": sessions})
        assert _core.sha1_hex(self.sess.text_bytes()) == sha
        self.current = name
        self.say(f"[saved {name}: {self.sess.n_past} tokens -> {os.path.basename(path)}]")

    def _file_state(self, sha: object) -> str:
        if not isinstance(sha, str) or not is_checkpoint_name(legacy_name(sha)):
            return "bad"
        paths = (self._store().path_for(sha, abi) for abi in (self.sess.payload_abi, None))
        return "ok" if any(os.path.exists(p) for p in paths) else "gone"

    def cmd_list(self) -> None:
        sessions = self.load_index()
        if not sessions:
            self.say("[no saved sessions]")
            return
        rows = []
        for name, e in sorted(sessions.items(), key=lambda kv: -int(kv[1].get("saved", 0))):
            rows.append(
                [
                    "*" if name == self.current else " ",
                    name,
                    str(e.get("tokens", "?")),
                    age(e.get("saved", 0)),
                    self._file_state(e.get("sha", "")),
                    printable(str(e.get("title", "")))[:40],
                ]
            )
        buf = io.StringIO()
        table(rows, [" ", "NAME", "TOKENS", "SAVED", "FILE", "TITLE"], buf)
        self.err.write(buf.getvalue())
        self.err.flush()

    def _find(self, name: str) -> tuple[str, dict[str, Any]] | None:
        sessions = self.load_index()
        e = sessions.get(name)
        if e is not None:
            return name, e
        hits = [n for n in sessions if n.startswith(name)] if name else []
        if len(hits) != 1:
            self.say(f"[no saved session {name!r}]" if not hits else f"[ambiguous: {', '.join(sorted(hits))}]")
            return None
        return hits[0], sessions[hits[0]]

    def cmd_switch(self, name: str) -> None:
        found = self._find(name)
        if found is None:
            return
        name, e = found
        msgs = e.get("messages")
        if not isinstance(msgs, list):
            self.say(f"[index entry {name!r} has no transcript]")
            return
        rendered = self.sess.key_of(
            tokenize_prompt(self.engine, self.engine.render_chat(msgs, add_generation_prompt=False))
        )
        sha = e.get("sha", "")
        if not isinstance(sha, str) or not is_checkpoint_name(legacy_name(sha)):
            self.sess.invalidate("switch: no valid checkpoint key")
            self.say(f"[switched to {name}: its index entry names no valid checkpoint; the next turn prefills]")
        else:
            r = load_named(self._store(), self.sess, sha, rendered)
            if r.status == "loaded":
                self.say(f"[switched to {name}: {r.tokens} tokens loaded from disk in {r.ms:.1f} ms, no prefill]")
            elif r.status == "missing":
                self.sess.invalidate("switch: checkpoint missing")
                self.say(f"[switched to {name}: checkpoint gone (evicted?); the next turn prefills]")
            elif r.status == "corrupt" and r.error is not None:
                self.say(
                    f"[switched to {name}: checkpoint rejected ({r.error.stage}/{r.error.code}) and removed; "
                    "the next turn prefills]"
                )
            elif r.error is not None:
                self.say(f"[switched to {name}: checkpoint unusable ({r.error.code}); the next turn prefills]")
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

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self._intr = True

    def turn(self, user_text: str) -> None:
        self.messages.append({"role": "user", "content": user_text})
        prompt = self.engine.render_chat(self.messages)
        params = GenParams(max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed)
        self._intr = False
        bar = ProgressBar(check=self._check_intr)

        def on_start(rep: RecoveryReport) -> None:
            bar.close()

        def on_text(s: str) -> None:
            self.out.write(printable(s))
            self.out.flush()

        old = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            res = self.gen.generate(
                prompt, params, on_start=on_start, on_text=on_text, cancel=lambda: self._intr, progress=bar
            )
        except (KeyboardInterrupt, ContextOverflowError, EngineError) as e:
            bar.close()
            self.messages.pop()
            self.say(self._rolled_back(e))
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

    def _rolled_back(self, e: BaseException) -> str:
        if isinstance(e, KeyboardInterrupt):
            state = "valid" if self.sess.checkpoint_valid else "invalidated"
            return f"\n[interrupted during prefill; turn rolled back; session {state}]"
        if isinstance(e, ContextOverflowError):
            return f"[{e}; use /new or /clear]"
        return f"[engine error: {e}; turn rolled back, session invalidated]"

    # -- the loop ----------------------------------------------------------------
    HELP = (
        "commands: /save NAME  /list  /switch NAME  /new  /clear  /quit\nCtrl+C stops generation; Ctrl+D or /quit exits"
    )

    def _new(self, arg: str) -> None:
        self.reset_to_system()
        self.say("[new conversation]")

    def command(self, cmd: str, arg: str) -> bool:
        """Run one /command; False means quit."""
        if cmd in ("/quit", "/exit"):
            return False
        local = {"/help": lambda a: self.say(self.HELP), "/clear": lambda a: self.cmd_clear(), "/new": self._new}
        stored = {"/save": self.cmd_save, "/list": lambda a: self.cmd_list(), "/switch": self.cmd_switch}
        if cmd in local:
            local[cmd](arg)
        elif cmd in stored and self.store is None:
            self.say("[no checkpoint directory: start with --kv-disk-dir]")
        elif cmd in stored:
            stored[cmd](arg)
        else:
            self.say(f"[unknown command {cmd}; /help]")
        return True

    def handle(self, line: str) -> bool:
        """Run one input line; False means quit."""
        line = line.strip()
        if not line:
            return True
        if line.startswith("/"):
            cmd, _, arg = line.partition(" ")
            return self.command(cmd, arg.strip())
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


def cmd_chat(args: argparse.Namespace) -> int:
    msg = check_kv_args(args)
    if msg:
        print(f"ds4 chat: {msg}", file=sys.stderr)
        return EXIT_USAGE
    store = make_store(args)
    gen = TurnDriver(build_engine(args.engine, args.model, args.threads, getattr(args, "exact", None)), args.ctx, store)
    try:
        repl = ChatREPL(gen, args.system, args.max_tokens, temperature=args.temperature, seed=args.seed)
        return repl.loop()
    finally:
        if store is not None:
            store.close()  # the shared tier's queued uploads finish first
