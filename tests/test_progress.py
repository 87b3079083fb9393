"""The prefill progress a person sees (issue 25, item 4), in process: the
CLI's bar (:class:`ds4.cli.progress.ProgressBar`) on a stream that says it
is a terminal, with its own clock (no test waits); the ladder telling it
which rung served the rest; and the server's info-level prefill lines
(``ProgressLog``) for a long prompt. The commands under a pty are
tests/test_cli_progress.py."""

from __future__ import annotations

import functools
import io
import logging
import re
import types

import pytest
from starlette.testclient import TestClient

import ds4
from ds4.cli.progress import DEFAULT_DELAY, ProgressBar, progress_delay
from ds4.kvstore import KVStore
from ds4.server import worker
from ds4.server.app import create_app
from ds4.server.worker import ProgressLog, Service
from ds4.turn import TurnDriver


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _bar(delay=1.0, every=0.1, columns=120, stream=None, **kw):
    clock = Clock()
    bar = ProgressBar(
        stream=stream if stream is not None else Tty(), delay=delay, every=every, clock=clock, columns=columns, **kw
    )
    return bar, clock


def test_nothing_is_written_when_the_stream_is_not_a_terminal():
    checked = []
    out = io.StringIO()  # isatty() is False
    bar, clock = _bar(delay=0, stream=out, check=lambda: checked.append(1))
    bar.serving("disk", 10)
    for done in range(0, 101, 10):
        clock.t += 5
        bar(done, 100)
    bar.close()
    assert out.getvalue() == "" and len(checked) == 11  # the check still runs on every update


def test_the_bar_waits_for_the_delay_then_redraws_throttled_and_is_erased():
    bar, clock = _bar(delay=1.0, every=0.25)  # steps a float adds exactly
    out = bar.stream
    clock.t += 0.5
    bar(100, 1000)
    assert out.getvalue() == ""  # a prefill shorter than the delay shows nothing
    clock.t += 0.5  # 1 s in
    bar(200, 1000)
    first = out.getvalue()
    assert first.startswith("\r\x1b[Kprefill [") and " 200/1000 tok   200 tok/s eta   4s" in first
    clock.t += 0.125
    bar(210, 1000)
    assert out.getvalue() == first  # throttled: less than `every` since the last draw
    clock.t += 0.125
    bar(300, 1000)
    assert out.getvalue().count("\r\x1b[K") == 2
    clock.t += 0.125
    bar(1000, 1000)  # a pass's last update is drawn whatever the throttle says
    assert out.getvalue().count("\r\x1b[K") == 3 and "1000/1000 tok" in out.getvalue()
    bar.close()
    assert out.getvalue().endswith("\r\x1b[K") and out.getvalue().count("\r\x1b[K") == 4
    bar.close()  # once erased, nothing more
    assert out.getvalue().count("\r\x1b[K") == 4


def test_a_bar_never_drawn_writes_nothing_on_close():
    bar, _ = _bar(delay=1.0)
    bar(1, 10)
    bar.close()
    assert bar.stream.getvalue() == ""


def test_the_rung_and_its_cached_tokens_and_the_rate_from_the_prefills_start():
    bar, clock = _bar(delay=0)
    clock.t += 30  # the ladder's lookup and load: not the prefill's time
    bar.serving("disk", 2048)
    clock.t += 2
    bar(1500, 3000)
    line = bar.stream.getvalue()
    assert line.endswith(" 1500/3000 tok   750 tok/s eta   2s, rung=disk cached=2048"), line
    assert re.fullmatch(r"\r\x1b\[Kprefill \[#{15}\.{15}\] .*", line), line  # half of 30 cells


def test_the_line_fits_the_terminal():
    for cols in (40, 60, 80, 200):
        bar, clock = _bar(delay=0, columns=cols)
        bar.serving("prefill", 0)
        clock.t += 1
        bar(12345, 23456)
        line = bar.stream.getvalue().removeprefix("\r\x1b[K")
        assert len(line) <= cols - 1 and line.startswith("prefill ["), (cols, line)
    assert "rung=prefill cached=0" in line


@pytest.mark.parametrize(("env", "want"), [(None, DEFAULT_DELAY), ("0", 0.0), ("2.5", 2.5), ("x", 1.0), ("-1", 1.0)])
def test_the_delay_knob(monkeypatch, env, want):
    assert DEFAULT_DELAY == 1.0  # "prefills longer than a second"
    if env is None:
        monkeypatch.delenv("DS4_PROGRESS_DELAY", raising=False)
    else:
        monkeypatch.setenv("DS4_PROGRESS_DELAY", env)
    assert progress_delay() == want
    assert ProgressBar(stream=Tty()).delay == want


# -- the ladder says which rung served the rest -----------------------------------
class Recorder:
    def __init__(self):
        self.events = []

    def serving(self, rung, reused):
        self.events.append(("serving", rung, reused))

    def __call__(self, done, total):
        self.events.append(("progress", done, total))


TEXT = "The harbour master counts the boats that come in with the tide. " * 12


def test_the_ladder_names_the_rung_before_each_prefill(tmp_path, eng):
    store = KVStore(tmp_path / "kv", min_tokens=16)
    prompt = eng.render_chat([{"role": "user", "content": TEXT}])
    cold = Recorder()
    rep = ds4.recover(ds4.Session(eng, ctx=2048), store, prompt, cold_save=True, progress=cold)
    assert rep.rung == "prefill" and rep.cold_saved
    announced = [e for e in cold.events if e[0] == "serving"]
    assert announced and all(e == ("serving", "prefill", 0) for e in announced)
    assert cold.events[0][0] == "serving"  # before the first update
    # a fresh session, a longer prompt: the disk rung served the stored prefix
    longer = eng.render_chat([{"role": "user", "content": TEXT + "What do they count at night?"}])
    rec = Recorder()
    rep = ds4.recover(ds4.Session(eng, ctx=2048), store, longer, progress=rec)
    assert rep.rung == "disk" and rep.reused_tokens > 0
    assert rec.events[0] == ("serving", "disk", rep.reused_tokens)
    done, total = rec.events[-1][1:]
    assert done == total == rep.prompt_tokens - rep.reused_tokens
    # all of it live: nothing to prefill, nothing announced
    sess = ds4.Session(eng, ctx=2048)
    ds4.recover(sess, store, longer)
    rec = Recorder()
    assert ds4.recover(sess, store, longer, progress=rec).rung == "live" and rec.events == []


def test_a_plain_callable_is_still_a_progress(tmp_path, eng):
    seen = []
    prompt = eng.render_chat([{"role": "user", "content": TEXT}])
    rep = ds4.recover(ds4.Session(eng, ctx=2048), None, prompt, progress=lambda d, t: seen.append((d, t)))
    assert rep.rung == "prefill" and seen[-1] == (rep.prompt_tokens, rep.prompt_tokens)


# -- the server's info-level prefill lines ----------------------------------------
LINE = re.compile(r"job (\d+) prefill (\d+)/(\d+) \((\d+\.\d)%\) avg=(\d+\.\d) t/s (\d+\.\d)s")


def test_progress_log_writes_one_info_line_every_two_seconds(monkeypatch, caplog):
    clock = Clock()
    monkeypatch.setattr(worker, "time", types.SimpleNamespace(perf_counter=clock))
    log = ProgressLog("job 7")
    with caplog.at_level(logging.INFO, logger="ds4.server"):
        for dt, done in ((1.0, 500), (1.0, 1000), (0.5, 1200), (1.6, 2000)):
            clock.t += dt
            log(done, 4000)
    lines = [r for r in caplog.records if LINE.fullmatch(r.getMessage())]
    assert [r.levelno for r in lines] == [logging.INFO, logging.INFO]
    assert [r.getMessage() for r in lines] == [
        "job 7 prefill 1000/4000 (25.0%) avg=500.0 t/s 2.0s",
        "job 7 prefill 2000/4000 (50.0%) avg=487.8 t/s 4.1s",
    ]


def test_the_server_logs_a_long_prompts_prefill_at_info(eng, monkeypatch, caplog):
    # every update logged (the worker's ProgressLog, every=0): the test does
    # not wait the two seconds a long prefill takes to get its first line
    monkeypatch.setattr(worker, "ProgressLog", functools.partial(ProgressLog, every=0.0))
    service = Service(TurnDriver(eng, 4096), "ds4-reference")
    body = {"model": "any", "messages": [{"role": "user", "content": TEXT * 2}], "max_tokens": 2}
    with TestClient(create_app(service), base_url="http://127.0.0.1") as client:
        with caplog.at_level(logging.INFO, logger="ds4.server"):
            r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    got = [(r.levelno, LINE.fullmatch(r.getMessage())) for r in caplog.records if r.name == "ds4.server"]
    lines = [(lv, m) for lv, m in got if m]
    assert len(lines) >= 3 and all(lv == logging.INFO for lv, _ in lines)  # the reference engine: 256-token chunks
    done = [int(m.group(2)) for _, m in lines]
    assert done == sorted(done) and done[-1] == prompt_tokens
    assert {int(m.group(3)) for _, m in lines} == {prompt_tokens}  # no store: one pass, the whole prompt
