"""The web playground in a real browser: headless Debian chromium, driven through chromedriver
by selenium, against a real `tokenmill serve` process (SmolLM2, with an API key) on 127.0.0.1.

One server and one browser for the module; each test opens the page afresh with the tab's
storage cleared, so it starts without a key. Skipped, with the reason, when chromium,
chromedriver or selenium is missing (scripts/install.sh installs them)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

MODEL = "smollm2-135m-instruct"
API_KEY = "browser-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")

if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip(
        "chromium and chromium-driver are not installed (scripts/install.sh installs them)",
        allow_module_level=True,
    )
webdriver = pytest.importorskip(
    "selenium.webdriver", reason="selenium is not installed (scripts/install.sh installs it)"
)
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402

# Records every length the newest answer's text takes, in the page itself, so no growth step is
# missed between two WebDriver round trips.
WATCH_ANSWER = """
window.answerLengths = [];
new MutationObserver(() => {
  const answers = document.querySelectorAll('.msg.assistant .content');
  const length = answers.length ? answers[answers.length - 1].textContent.length : 0;
  if (length !== window.answerLengths.at(-1)) window.answerLengths.push(length);
}).observe(document.getElementById('messages'),
           {childList: true, subtree: true, characterData: true});
"""


@pytest.fixture(scope="module")
def server(smollm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """A `tokenmill serve` process, started (not yet ready): the browser starts meanwhile."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(smollm_path)]
    command += ["--served-model-name", MODEL, "--port", str(port), "--kv-cache-memory", "64MiB"]
    # With prompt-lookup drafting on, so the speculative figures have something to show.
    command += ["--api-key", API_KEY, "--speculative-method", "ngram"]
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    with log_path.open("w") as log:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            yield process, f"http://127.0.0.1:{port}", log_path
        finally:
            # Killed, not shut down gracefully: that takes seconds and test_app.py tests it.
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def server_url(server, browser) -> str:
    """The server's URL once it answers /health. (Asking for the browser here makes it quit
    before the server stops: a page still polling would hold the server's graceful shutdown.)"""
    process, url, log_path = server
    deadline = time.monotonic() + 180
    while not _healthy(url):
        assert process.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)
    return url


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument("--window-size=1100,900")
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def page(server_url, browser):
    """The playground, freshly loaded in a tab that holds no API key."""
    browser.get(server_url)
    browser.execute_script("sessionStorage.clear()")
    browser.get(server_url)
    browser.execute_script(WATCH_ANSWER)
    return browser


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def wait_for(condition: Callable[[], Any], timeout_s: float = 20, what: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what or condition}"
        time.sleep(0.05)


def metrics(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/metrics", headers=AUTH).json()


def element(driver, css: str):
    return driver.find_element(By.CSS_SELECTOR, css)


def enter_key(driver, key: str) -> None:
    form = wait_for(lambda: element(driver, "#key-form").is_displayed() and driver, what="key")
    field = element(form, "#api-key")
    field.clear()
    field.send_keys(key, Keys.ENTER)


def set_field(driver, css: str, value: str) -> None:
    field = element(driver, css)
    field.clear()
    field.send_keys(value)


def open_settings(driver) -> None:
    if element(driver, "#settings").get_attribute("open") is None:
        element(driver, "#settings summary").click()


def ask(driver, text: str, max_tokens: int) -> None:
    """Types a message and sends it with Enter, as a keyboard user would."""
    open_settings(driver)
    set_field(driver, "#max-tokens", str(max_tokens))
    set_field(driver, "#temperature", "0")
    element(driver, "#prompt").send_keys(text, Keys.ENTER)


def last_answer(driver) -> str:
    answers = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .content")
    return answers[-1].text if answers else ""


def answer_stats(driver) -> str:
    stats = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")
    return stats[-1].text if stats else ""


def test_the_api_refuses_the_page_until_the_key_is_entered(page, server_url):
    assert wait_for(lambda: element(page, "#key-form").is_displayed(), what="key form")
    generated = metrics(server_url)["total_generated_tokens"]
    ask(page, "Say hello.", max_tokens=4)
    time.sleep(1)
    assert last_answer(page) == ""
    assert metrics(server_url)["total_generated_tokens"] == generated
    enter_key(page, "wrong-key")
    wait_for(lambda: "refused" in element(page, "#key-message").text, what="refusal")
    assert last_answer(page) == ""
    key_given = time.monotonic()
    enter_key(page, API_KEY)
    stats = wait_for(lambda: "tokens" in (s := answer_stats(page)) and s, what="the answer")
    assert last_answer(page) != ""
    assert metrics(server_url)["total_generated_tokens"] > generated
    # the answer's TTFT is timed from its accepted attempt, not from the wait for the key
    assert float(stats.split("TTFT ")[1].split(" ms")[0]) <= 1000 * (time.monotonic() - key_given)


def test_an_answer_streams_in_and_its_figures_follow(page, server_url, tmp_path):
    enter_key(page, API_KEY)
    ask(page, "Write two sentences about the sea.", max_tokens=16)
    stats = wait_for(lambda: answer_stats(page), what="the answer's figures")
    lengths = page.execute_script("return window.answerLengths")
    growing = [n for n in lengths if n > 0]
    assert len(growing) >= 3 and growing == sorted(growing), lengths
    assert growing[-1] == len(last_answer(page))
    assert "TTFT" in stats and "tok/s" in stats and "tokens" in stats and "≈" not in stats
    page.save_screenshot(str(tmp_path / "playground.png"))
    assert (tmp_path / "playground.png").stat().st_size > 0


def test_speculative_acceptance_shows_under_the_answer_and_in_the_panel(page, server_url):
    enter_key(page, API_KEY)
    before = metrics(server_url)["spec_decode_draft_tokens"]
    line = "the quick brown fox jumps over the lazy dog"
    ask(page, f"Repeat this line three times: {line}. {line}.", max_tokens=16)
    stats = wait_for(lambda: "spec accepted" in (s := answer_stats(page)) and s, what="spec")
    assert metrics(server_url)["spec_decode_draft_tokens"] > before
    assert stats.split("spec accepted ")[1].split("%")[0].isdigit()
    wait_for(lambda: element(page, "#m-spec-box").is_displayed(), what="the panel's spec figure")
    assert element(page, "#m-spec").text.endswith("%")


def test_stop_aborts_the_answer_and_the_running_count_returns_to_0(page, server_url):
    enter_key(page, API_KEY)
    aborted = _aborted(server_url)
    ask(page, "Count from 1 to 500, separated by commas.", max_tokens=400)
    wait_for(lambda: element(page, "#m-running").text == "1", what="the panel to show 1 running")
    assert last_answer(page) != ""
    element(page, "#stop").click()
    wait_for(lambda: "stopped" in answer_stats(page), what="the stopped answer")
    wait_for(lambda: element(page, "#m-running").text == "0", what="the panel to show 0 running")
    summary = wait_for(
        lambda: (s := metrics(server_url))["kv_cache_blocks_in_use"] == 0 and s, what="free KV"
    )
    assert summary["num_requests_running"] == 0
    assert _aborted(server_url) == aborted + 1
    assert not element(page, "#send").get_attribute("disabled")


# Keeps the body of every chat request the page sends, then lets it through.
RECORD_REQUESTS = """
window.chatBodies = [];
const fetchAsIs = window.fetch;
window.fetch = (path, options) => {
  if (String(path).endsWith('/v1/chat/completions')) {
    window.chatBodies.push(JSON.parse(options.body));
  }
  return fetchAsIs(path, options);
};
"""


def test_the_settings_become_the_request_fields(page, server_url):
    enter_key(page, API_KEY)
    page.execute_script(RECORD_REQUESTS)
    open_settings(page)
    set_field(page, "#system", "You are terse.")
    set_field(page, "#top-p", "0.9")
    set_field(page, "#seed", "7")
    set_field(page, "#stop-strings", "END")
    schema = '{"type": "object", "properties": {"answer": {"type": "string"}}}'
    set_field(page, "#schema", schema)
    ask(page, "Hi", max_tokens=3)
    wait_for(lambda: answer_stats(page), what="the answer")
    (body,) = page.execute_script("return window.chatBodies")
    assert body["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
    ]
    assert body["model"] == MODEL and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0, 0.9, 3)
    assert body["seed"] == 7 and body["stop"] == ["END"]
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["schema"] == json.loads(schema)
    assert not element(page, "#model-picker").is_displayed()  # one model: no picker


def test_a_schema_that_is_not_json_is_refused_in_the_page(page, server_url):
    enter_key(page, API_KEY)
    page.execute_script(RECORD_REQUESTS)
    open_settings(page)
    set_field(page, "#schema", "{not json")
    element(page, "#prompt").send_keys("Hi", Keys.ENTER)
    error = wait_for(lambda: page.find_elements(By.CSS_SELECTOR, ".msg.error"), what="error")
    assert "not valid JSON" in error[0].text
    assert page.execute_script("return window.chatBodies") == []
    assert element(page, "#prompt").get_attribute("value") == "Hi"  # kept to fix and resend


def test_a_refused_request_shows_the_server_error_and_stays_out_of_the_history(page, server_url):
    enter_key(page, API_KEY)
    page.execute_script(RECORD_REQUESTS)
    ask(page, "First", max_tokens=10**6)
    error = wait_for(lambda: page.find_elements(By.CSS_SELECTOR, ".msg.error"), what="error")
    assert "maximum context length" in error[0].text and "max_tokens" in error[0].text
    ask(page, "Second", max_tokens=3)
    wait_for(lambda: "tokens" in answer_stats(page), what="the second answer")
    refused, accepted = page.execute_script("return window.chatBodies")
    assert refused["messages"] == [{"role": "user", "content": "First"}]
    assert accepted["messages"] == [{"role": "user", "content": "Second"}]


def test_the_live_panel_updates_and_fits_400_px(page, server_url, tmp_path):
    enter_key(page, API_KEY)
    polls = wait_for(lambda: int(element(page, "#dashboard").get_attribute("data-polls")))
    wait_for(lambda: int(element(page, "#dashboard").get_attribute("data-polls")) >= polls + 2)
    assert element(page, "#m-kv").text.endswith("%")
    assert element(page, "#m-running").text == "0"
    assert page.execute_script(_INKED, "chart-load")
    page.set_window_size(400, 900)
    try:
        wait_for(lambda: page.execute_script("return window.innerWidth") <= 400)
        width = page.execute_script("return document.documentElement.scrollWidth")
        assert width <= page.execute_script("return window.innerWidth")
        page.save_screenshot(str(tmp_path / "playground-400px.png"))
    finally:
        page.set_window_size(1100, 900)


# True when a canvas has any non-transparent pixel: a chart was drawn on it.
_INKED = """
const canvas = document.getElementById(arguments[0]);
const pixels = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
for (let i = 3; i < pixels.length; i += 4) if (pixels[i] !== 0) return true;
return false;
"""


def _aborted(url: str) -> float:
    prefix = 'tokenmill_request_success_total{finished_reason="abort"} '
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(lines[0].split()[1]) if lines else 0.0
