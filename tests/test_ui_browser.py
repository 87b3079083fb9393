"""``GET /ui`` in a real headless browser: Debian's chromium driven by
selenium through Debian's chromedriver (``/usr/bin/chromedriver``; selenium
is never left to fetch a driver of its own: its driver manager raising is a
failure). A real ``ds4 serve`` (reference engine, keys, an admin tenant):
the page asks for a key, shows the operator's view once given one, lists
the turns sent after it loaded and redraws its chart with them; a tenant's
key shows that tenant's turns only. A screenshot of each is saved under
pytest's tmp dir (its path printed), and the browser's console has no
error."""

from __future__ import annotations

import pytest
from helpers.server import KV_FLAGS, topic_chat
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service as ChromeService
from selenium.webdriver.common import selenium_manager
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
KA, KB, KOPS = "sk-ui-alice", "sk-ui-bob", "sk-ui-ops"
WAIT_S = 60


@pytest.fixture(scope="module")
def srv(serve_module, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ui")
    keys = tmp / "keys"
    keys.write_text(f"alice:{KA}\nbob:{KB}\nops:{KOPS}\n", encoding="utf-8")
    return serve_module(
        "--api-key-file", str(keys), "--admin-tenant", "ops", *KV_FLAGS, name="ui", tmp=tmp, kv=True, key=KOPS
    )


@pytest.fixture
def browser(monkeypatch):
    def no_manager(*a, **kw):
        raise AssertionError("selenium tried to fetch a driver (selenium-manager)")

    monkeypatch.setattr(selenium_manager.SeleniumManager, "binary_paths", no_manager)
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1600"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=ChromeService(executable_path=CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def _until(driver, what, cond):
    try:
        return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(lambda d: cond(d))
    except TimeoutException:
        raise AssertionError(f"the page never showed {what}: {driver.find_element(By.ID, 'status').text!r}") from None


def _enter_key(driver, key):
    _until(driver, "the key form", lambda d: d.find_element(By.ID, "key-form").is_displayed())
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.ID, "key-submit").click()


def _rows(driver) -> list[list[str]]:
    """The turns table's cells, read in one script (the page replaces the
    rows on each refresh: elements found one call earlier may be gone)."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('#turns tbody tr'))"
        ".map((tr) => Array.from(tr.cells).map((td) => td.textContent))"
    )


def _chart(driver) -> tuple[int, str]:
    """The chart's bars drawn (its ``data-points``) and its pixels."""
    c = driver.find_element(By.ID, "chart")
    return int(c.get_attribute("data-points")), driver.execute_script("return arguments[0].toDataURL()", c)


def _console_errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _screenshot(driver, path) -> None:
    assert driver.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot: {path}")


def test_page_shows_turns_and_redraws_its_chart(srv, browser, tmp_path):
    browser.get(srv.base + "/ui")
    assert "a key is needed" in browser.find_element(By.ID, "status").text
    assert srv.base + "/ui" == browser.current_url  # nothing of a key in the URL, now or later
    _enter_key(browser, KOPS)
    _until(browser, "the operator's view", lambda d: "operator view" in d.find_element(By.ID, "status").text)
    assert not browser.find_element(By.ID, "key-form").is_displayed()  # the key taken, its form gone
    before_rows = len(_rows(browser))
    points0, pixels0 = _chart(browser)

    model = srv.model()
    a, b = srv.client(KA), srv.client(KB)
    first = a.chat.completions.create(model=model, messages=topic_chat("lighthouses"), max_tokens=4)
    follow = [*topic_chat("lighthouses"), first.choices[0].message.model_dump(exclude_none=True)]
    a.chat.completions.create(model=model, messages=[*follow, {"role": "user", "content": "More?"}], max_tokens=3)
    b.completions.create(model=model, prompt="Tides rise because", max_tokens=3)

    rows = _until(browser, "the three turns", lambda d: (r := _rows(d)) and len(r) >= before_rows + 3 and r)
    newest = rows[:3]  # newest first: bob's completion, alice's two chats
    assert [r[1] for r in newest] == ["completions", "chat", "chat"]
    assert [r[2] for r in newest] == ["bob", "alice", "alice"]
    assert newest[2][3] == "prefill" and newest[1][3] in ("live", "rewrite", "disk")
    cached, prompt = (int(x) for x in newest[1][4].split(" / "))
    assert 0 < cached <= prompt  # the continuation resumed (from memory or its checkpoint)
    # bob's prompt is under --kv-cache-min-tokens: its cold save skipped, and why
    assert "cold save skipped: below_min_tokens (" in newest[0][7], newest[0]
    assert " tokens < min 32)" in newest[0][7]
    _until(browser, "the skips by code", lambda d: "below_min_tokens" in d.find_element(By.ID, "skips").text)
    points, _ = _until(browser, "the chart redrawn", lambda d: (c := _chart(d))[0] >= 1 and c[1] != pixels0 and c)
    assert points >= max(1, points0)
    # the checkpoint table is copied from the index at most every CHECKPOINTS_EVERY_S (5 s)
    _until(browser, "the checkpoints", lambda d: d.find_elements(By.CSS_SELECTOR, "#checkpoints tbody tr"))
    assert "alice" in browser.find_element(By.ID, "tenants").text  # bob's prompt is under --kv-cache-min-tokens
    _screenshot(browser, tmp_path / "ui-operator.png")
    assert srv.base + "/ui" == browser.current_url
    assert _console_errors(browser) == []


def test_tenant_key_sees_its_own_turns(srv, browser, tmp_path):
    model = srv.model()
    srv.client(KB).completions.create(model=model, prompt="Bob asks about tides", max_tokens=2)
    browser.get(srv.base + "/ui")
    _enter_key(browser, KA)
    _until(browser, "alice's view", lambda d: "tenant alice" in d.find_element(By.ID, "status").text)
    alice = srv.client(KA)
    alice.completions.create(model=model, prompt="Alice asks about lighthouses", max_tokens=2)
    rows = _until(browser, "alice's turn", lambda d: (r := _rows(d)) and r[0][1] == "completions" and r)
    assert all(len(r) == 7 for r in rows)  # no tenant column for a tenant
    assert "cold save skipped: below_min_tokens" in rows[0][6]  # her prompt too is under the minimum
    assert not browser.find_element(By.ID, "skips").is_displayed()  # the operator's
    assert not browser.find_element(By.ID, "checkpoints").is_displayed()
    assert not browser.find_element(By.ID, "t-queued").is_displayed()
    _screenshot(browser, tmp_path / "ui-tenant.png")
    assert _console_errors(browser) == []
