"""The web playground (issue 19) in a real browser: Debian's chromium driven by Selenium against a
live `tokenwire serve` on SmolLM2 with a concept file built by `tokenwire concepts build`.

Screenshots of each state land in the test's output directory (printed; pytest keeps the last
three runs' directories under its basetemp). `make install` installs chromium and its driver;
these tests fail, not skip, when they are missing.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import pytest

from tests.protocols.openai.conftest import MODEL, InProcess, http, openai_only_serve

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
PROMPT = "The capital of France is"
CMD = [sys.executable, "-m", "tokenwire.cli"]
AXE = Path(__file__).parents[2] / "web" / "node_modules" / "axe-core" / "axe.min.js"


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("playground")
    print(f"playground screenshots: {path}")
    return path


@pytest.fixture(scope="module")
def server(out_dir: Path) -> Iterator[str]:
    """http://127.0.0.1:PORT of a `tokenwire serve` with only the HTTP API on and a `joy` concept."""
    (out_dir / "pos.txt").write_text("I am so happy today!\nWhat a wonderful, joyful day.\n")
    (out_dir / "neg.txt").write_text("I am so sad today.\nWhat a terrible, miserable day.\n")
    concepts = out_dir / "joy.safetensors"
    built = subprocess.run(
        [
            *CMD,
            "concepts",
            "build",
            "--name",
            "joy",
            "--positive",
            str(out_dir / "pos.txt"),
            "--negative",
            str(out_dir / "neg.txt"),
            "--layers",
            "0,10,30",
            "-o",
            str(concepts),
            "--kv-cache-mb",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    with openai_only_serve("--concepts", str(concepts)) as (port, _):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def browser(out_dir: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    assert Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists(), "run `make install` (apt chromium)"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,800",
        f"--user-data-dir={out_dir / 'chromium-profile'}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(60)
    viewport(driver, 1280, 800)
    try:
        yield driver
    finally:
        driver.quit()


def viewport(driver: Any, width: int, height: int, mobile: bool = False) -> None:
    """The page's viewport exactly (a headless window's size includes no chrome but varies)."""
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile},
    )


def wait_for(predicate: Callable[[], Any], timeout: float = 60, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def js(driver: Any, script: str, *args: Any) -> Any:
    return driver.execute_script(script, *args)


def wait_for_page(driver: Any) -> None:
    """Until the page's script says it is ready. Right after a navigation the script can run
    before <body> exists (a clean-clone run failed reading null.dataset): not ready yet."""
    wait_for(
        lambda: js(driver, "return !!document.body && document.body.dataset.ready === 'true'"),
        what="the page to start",
    )


def tokens(driver: Any) -> list[dict[str, Any]]:
    """The token boxes of the selected branch as the page shows them."""
    return js(
        driver,
        """return [...document.querySelectorAll('#tokens .tok')].map(e => ({
             text: e.dataset.text, prompt: e.classList.contains('prompt'), pos: Number(e.dataset.pos),
             logprob: e.dataset.logprob === '' ? null : Number(e.dataset.logprob),
             bg: getComputedStyle(e).backgroundColor, fg: getComputedStyle(e).color}))""",
    )


def generate(driver: Any, *, prompt: str | None = None, regex: str = "", max_tokens: int = 8) -> None:
    js(
        driver,
        """const [prompt, regex, max] = arguments;
           if (prompt !== null) document.getElementById('prompt').value = prompt;
           document.getElementById('constraint-kind').value = regex ? 'regex' : '';
           document.getElementById('constraint').value = regex;
           document.getElementById('max_tokens').value = String(max);
           document.getElementById('status').textContent = '';""",
        prompt,
        regex,
        max_tokens,
    )
    driver.find_element("id", "generate").click()
    wait_done(driver)


def wait_done(driver: Any) -> None:
    wait_for(
        lambda: js(
            driver,
            """const s = document.getElementById('status').textContent;
               return !document.getElementById('generate').disabled
                      && (/Generated|Stopped/.test(s) || !document.getElementById('error').hidden);""",
        ),
        what="the generation to end",
    )


def api_completion(server: str, prompt: Any, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    status, _, body = http(
        "POST",
        f"{server}/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra},
        key=None,
    )
    assert status == 200, body
    return body


def shot(driver: Any, out_dir: Path, name: str) -> None:
    driver.save_screenshot(str(out_dir / f"{name}.png"))


def severe_console(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def axe_serious(driver: Any) -> list[str]:
    """axe-core's scan of the page as it is: the serious and critical violations."""
    assert AXE.exists(), "run `make install` (npm ci in tests/web installs axe-core)"
    if not js(driver, "return !!window.axe"):
        js(driver, AXE.read_text())
    result = driver.execute_async_script(
        """const done = arguments[arguments.length - 1];
           axe.run(document, {resultTypes: ['violations']}).then(r => done(r.violations.map(
               v => [v.impact, v.id, v.nodes.map(n => n.target.join(' ')).slice(0, 3).join(', ')])));"""
    )
    return [
        f"{impact} {rule}: {nodes}" for impact, rule, nodes in result if impact in ("serious", "critical")
    ]


def luminance(css: str) -> float:
    r, g, b = (int(v) for v in css[css.index("(") + 1 : css.index(")")].split(",")[:3])

    def channel(c: int) -> float:
        s = c / 255
        return s / 12.92 if s <= 0.03928 else ((s + 0.055) / 1.055) ** 2.4

    return 0.2126 * channel(r) + 0.7152 * channel(g) + 0.0722 * channel(b)


def contrast(a: str, b: str) -> float:
    la, lb = sorted((luminance(a), luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


# ---------------------------------------------------------------------------------------------


def test_page_files_and_stats_route(random_engine: Any) -> None:
    """The page and its modules from the package; /stats follows the engine (no API key needed)."""
    import urllib.request

    server = InProcess(random_engine, api_key="k")
    try:
        root = server.url.removesuffix("/v1")
        for path, kind, needle in [
            ("/", "text/html", b'<script type="module" src="/playground/app.js">'),
            ("/playground/app.js", "javascript", b"import"),
            ("/playground/style.css", "text/css", b"#tokens"),
        ]:
            with urllib.request.urlopen(root + path, timeout=10) as response:
                assert kind in response.headers["Content-Type"] and needle in response.read()
        status, _, stats = http("GET", root + "/stats", key=None)
        assert status == 200 and stats["model"] == MODEL and stats["sessions"] == 0
        assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_total"] > 0 and stats["concepts"] == []
        _, _, session = http("POST", server.url + "/sessions", {"prompt": list(range(40))}, key="k")
        after = http("GET", root + "/stats", key=None)[2]
        assert after["sessions"] == 1 and after["time"] >= stats["time"]
        http("DELETE", f"{server.url}/sessions/{session['id']}", key="k")
        assert http("GET", root + "/stats", key=None)[2]["sessions"] == 0
    finally:
        server.close()


# ---------------------------------------------------------------------------------------------


def test_stream_tokens_hover_keyboard_fork_and_close(browser: Any, server: str, out_dir: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    driver = browser
    driver.get(server + "/")
    wait_for_page(driver)
    assert driver.title == "tokenwire playground"
    assert js(driver, "return [innerWidth, innerHeight]") == [1280, 800]
    assert js(driver, "return document.getElementById('model-name').textContent") == MODEL
    shot(driver, out_dir, "01-loaded")

    # the engine panel polls /stats every second
    polls = int(
        wait_for(
            lambda: js(driver, "return document.getElementById('engine').dataset.polls"),
            what="the engine panel",
        )
    )
    wait_for(
        lambda: int(js(driver, "return document.getElementById('engine').dataset.polls")) >= polls + 2,
        timeout=15,
        what="two more engine polls",
    )
    assert "blocks" in js(driver, "return document.getElementById('kv-usage').textContent")

    # streamed: the box count grows chunk by chunk (recorded at each DOM change). 48 tokens take
    # long enough (~0.5 s) that a browser starved of CPU by the engine still sees several chunks.
    js(
        driver,
        """window.__counts = [];
                  new MutationObserver(() => window.__counts.push(
                      document.querySelectorAll('#tokens .tok.generated').length))
                    .observe(document.getElementById('tokens'), {childList: true, subtree: true});""",
    )
    generate(driver, prompt=PROMPT, max_tokens=48)
    counts = js(driver, "return window.__counts")
    assert any(0 < c < 48 for c in counts), counts  # some boxes were shown before the last came
    driver.get(server + "/")  # a fresh page (a second Generate would continue this text)
    wait_for_page(driver)
    generate(driver, prompt=PROMPT, max_tokens=8)
    shot(driver, out_dir, "02-generated")
    assert js(driver, "return document.getElementById('error').hidden"), js(
        driver, "return document.getElementById('error').textContent"
    )
    expected = api_completion(server, PROMPT, 8, echo=True, logprobs=5)
    legacy = expected["choices"][0]["logprobs"]
    shown = tokens(driver)
    assert [t["text"] for t in shown] == legacy["tokens"]  # prompt tokens (scored) and the answer
    generated = [t for t in shown if not t["prompt"]]
    n_prompt = expected["usage"]["prompt_tokens"]
    assert len(generated) == expected["usage"]["completion_tokens"] == 8
    assert "".join(t["text"] for t in generated) == expected["choices"][0]["text"][len(PROMPT) :]
    assert js(driver, "return document.getElementById('tokens').dataset.generated") == "8"
    for t, lp in zip(shown, legacy["token_logprobs"], strict=True):
        assert (t["logprob"] is None) == (lp is None) and (
            lp is None or math.isclose(t["logprob"], lp, abs_tol=1e-4)
        )
    # coloured by probability: the scored boxes are not the unscored grey, and text keeps AA contrast
    assert all(t["bg"] != shown[0]["bg"] for t in shown[1:])
    assert min(contrast(t["bg"], t["fg"]) for t in shown) >= 4.5
    legend = js(
        driver,
        """return [...document.querySelectorAll('#legend .swatch')].map(
                             e => [getComputedStyle(e).backgroundColor, getComputedStyle(e).color])""",
    )
    assert len(legend) >= 5 and min(contrast(bg, fg) for bg, fg in legend) >= 4.5

    # hover a generated token: its alternatives, the top one the API's top logprob there
    boxes = driver.find_elements("css selector", "#tokens .tok")
    ActionChains(driver).move_to_element(boxes[n_prompt + 1]).perform()
    top = legacy["top_logprobs"][n_prompt + 1]
    best = max(top, key=top.get)

    def first_alternative() -> list[str] | None:
        return js(
            driver,
            """const r = document.querySelector('#detail table.alternatives tr:nth-of-type(2)');
                             return r ? [...r.querySelectorAll('td')].map(c => c.textContent) : null""",
        )

    row = wait_for(first_alternative, timeout=15, what="alternatives on hover")
    assert row[0] == best and math.isclose(float(row[1]), math.exp(top[best]), abs_tol=1e-4)
    assert f"position {n_prompt + 1}" in js(driver, "return document.getElementById('detail').textContent")
    shot(driver, out_dir, "03-hover")

    # keyboard: Tab reaches the token list, arrows move, focus shows the alternatives too, Enter selects
    js(driver, "[...document.querySelectorAll('#colour-controls select')].at(-1).focus()")
    ActionChains(driver).send_keys(Keys.TAB).perform()
    assert js(driver, "return document.activeElement.classList.contains('tok')")
    ActionChains(driver).send_keys(Keys.HOME).send_keys(Keys.ARROW_RIGHT * 3).perform()
    assert js(driver, "return document.activeElement.dataset.pos") == "3"
    assert "position 3" in js(driver, "return document.getElementById('detail').textContent")
    ActionChains(driver).send_keys(Keys.ENTER).perform()
    fork = wait_for(lambda: driver.find_elements("id", "fork-here"), timeout=15, what="the fork button")[0]
    assert js(driver, "return document.activeElement.getAttribute('aria-selected')") == "true"
    shot(driver, out_dir, "04-selected")

    # fork at token 3 and generate: a second branch, nested under the first, sharing 3 tokens
    parent_id = js(driver, "return document.querySelector('#tree > li').dataset.session")
    js(driver, "document.getElementById('status').textContent = ''")  # wait_done waits for the next
    ActionChains(driver).send_keys(Keys.TAB).perform()  # from the selected token to its fork button
    assert js(driver, "return document.activeElement.id") == "fork-here"
    assert fork.text == "Fork here (keep 3 tokens) and generate"
    ActionChains(driver).send_keys(Keys.ENTER).perform()
    wait_done(driver)
    assert js(driver, "return document.getElementById('error').hidden")
    ids = js(
        driver, "return [...document.querySelectorAll('#tree li[data-session]')].map(e => e.dataset.session)"
    )
    assert len(ids) == 2 and ids[0] == parent_id
    assert js(driver, "return document.querySelectorAll('#tree > li > ul > li').length") == 1
    child_id = ids[1]
    child_tokens = tokens(driver)
    assert [t["text"] for t in child_tokens[:3]] == [t["text"] for t in shown[:3]]
    assert len(child_tokens) > 3 and not child_tokens[3]["prompt"]
    _, _, parent_session = http("GET", f"{server}/v1/sessions/{parent_id}", key=None)
    status, _, child_session = http("GET", f"{server}/v1/sessions/{child_id}", key=None)
    assert status == 200 and child_session["tokens"][:3] == parent_session["tokens"][:3]
    assert child_session["length"] == len(child_tokens)
    shot(driver, out_dir, "05-forked")
    assert axe_serious(driver) == []  # two branches, a selected token, alternatives: the busiest state

    # the first branch is still selectable, with its own tokens
    driver.find_element("css selector", f'#tree li[data-session="{parent_id}"] .select').click()
    assert [t["text"] for t in tokens(driver)] == legacy["tokens"]

    # closing the second branch frees its session on the server
    sessions_before = http("GET", f"{server}/stats", key=None)[2]["sessions"]
    driver.find_element("css selector", f'#tree li[data-session="{child_id}"] .close').click()
    wait_for(
        lambda: http("GET", f"{server}/v1/sessions/{child_id}", key=None)[0] == 404,
        timeout=10,
        what="the session to be deleted",
    )
    assert http("GET", f"{server}/stats", key=None)[2]["sessions"] == sessions_before - 1
    # the page drops the branch once its DELETE has answered: the server can say 404 a moment
    # before the page has read that answer (a clean-clone run saw both branches still listed)
    wait_for(
        lambda: js(driver, "return document.querySelectorAll('#tree li[data-session]').length") == 1,
        timeout=10,
        what="the closed branch to leave the tree",
    )
    assert http("GET", f"{server}/v1/sessions/{parent_id}", key=None)[0] == 200

    assert js(driver, "return document.documentElement.scrollWidth") <= 1280
    # the engine panel counted the work (tokens/s shown once two polls have been taken)
    wait_for(
        lambda: js(driver, "return /^[0-9.]+$/.test(document.getElementById('tps').textContent)"),
        timeout=15,
        what="tokens/s",
    )
    assert severe_console(driver) == []


def test_the_engine_panel_shows_guesses_kept(browser: Any, server: str) -> None:
    """A completion copying its prompt runs prompt-lookup guesses; the panel shows the share kept
    and the tokens a guessing step made, as /stats counts them."""
    driver = browser
    driver.get(server + "/")
    wait_for_page(driver)
    text = "The cat sat on the mat. The dog sat on the log. " * 6
    body = {"model": MODEL, "prompt": text + "The cat", "max_tokens": 48, "temperature": 0}
    status, _, _ = http("POST", f"{server}/v1/completions", body)
    assert status == 200
    stats = http("GET", f"{server}/stats", key=None)[2]
    assert stats["spec_proposed"] >= stats["spec_accepted"] > 0
    # the panel may first show a poll taken while the completion ran: wait for the final counts
    counts = f"({stats['spec_accepted']}/{stats['spec_proposed']})"

    def shown() -> str:
        text = js(driver, "return document.getElementById('spec').textContent")
        return text if counts in text else ""

    label = wait_for(shown, timeout=15, what="the guesses kept")
    # JavaScript's toFixed rounds the double's exact value half up (57/80: "71.3"); Python's
    # format rounds half to even ("71.2")
    kept = Decimal(100 * stats["spec_accepted"] / stats["spec_proposed"]).quantize(
        Decimal("0.1"), ROUND_HALF_UP
    )
    assert label.startswith(f"{kept}% {counts}, ") and label.endswith("tokens a step")
    # the requests of each API, as /metrics counts them (Anthropic's and Ollama's get their own)
    status, _, _ = http("POST", f"{server}/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False,
                                                         "options": {"num_predict": 2}})  # fmt: skip
    assert status == 200
    by_api = http("GET", f"{server}/stats", key=None)[2]["requests_by_protocol"]
    assert by_api.get("openai", 0) >= 1 and by_api.get("ollama", 0) >= 1, by_api

    def apis_shown() -> str:
        text = js(driver, "return document.getElementById('by-protocol').textContent")
        return text if "ollama" in text and "openai" in text else ""

    wait_for(apis_shown, timeout=15, what="the requests by API")
    assert severe_console(driver) == []


def test_invalid_regex_shows_the_server_error_and_the_page_keeps_working(
    browser: Any, server: str, out_dir: Path
) -> None:
    driver = browser
    driver.get(server + "/")
    wait_for_page(driver)
    status, _, error = http(
        "POST", f"{server}/v1/completions", {"model": MODEL, "prompt": "x", "regex": "(["}, key=None
    )
    assert status == 400
    generate(driver, prompt="Year: ", regex="([")
    shown = js(driver, "return document.getElementById('error').textContent")
    assert shown == error["error"]["message"]
    assert js(driver, "return document.getElementById('error').getAttribute('role')") == "alert"
    shot(driver, out_dir, "06-invalid-regex")
    generate(driver, prompt="Year: ", regex="[0-9]{4}", max_tokens=6)
    assert js(driver, "return document.getElementById('error').hidden")
    answer = "".join(t["text"] for t in tokens(driver) if not t["prompt"])
    assert len(answer) == 4 and answer.isdigit()
    # chat mode with a JSON schema: the reply parses and has the schema's keys
    js(
        driver,
        """document.querySelector('input[name=mode][value=chat]').click();
           document.getElementById('new-session').click();""",
    )
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["city", "year"],
        "additionalProperties": False,
    }
    js(
        driver,
        """document.getElementById('prompt').value = arguments[0];
           document.getElementById('max_tokens').value = '40';
           document.getElementById('constraint-kind').value = 'json';
           document.getElementById('constraint').value = arguments[1];
           document.getElementById('status').textContent = '';""",
        "Name a city and a year as JSON.",
        json.dumps(schema),
    )
    driver.find_element("id", "generate").click()
    wait_done(driver)
    assert js(driver, "return document.getElementById('error').hidden")
    reply = json.loads("".join(t["text"] for t in tokens(driver)))
    assert set(reply) == {"city", "year"} and isinstance(reply["year"], int)
    shot(driver, out_dir, "07-chat-json")
    # 404s of the first request aside, nothing went to the console as an error
    assert [m for m in severe_console(driver) if "400" not in m] == []


def test_readout_colouring_and_chart(browser: Any, server: str, out_dir: Path) -> None:
    driver = browser
    driver.get(server + "/")
    wait_for_page(driver)
    assert js(driver, "return [...document.getElementById('concept').options].map(o => o.text)") == ["joy"]
    generate(driver, prompt="What a wonderful day, and then", max_tokens=4)
    before = [t["bg"] for t in tokens(driver)]
    js(
        driver,
        """const s = document.getElementById('colour-by'); s.value = 'readout';
                  s.dispatchEvent(new Event('change'));""",
    )
    after = tokens(driver)
    assert [t["bg"] for t in after] != before and len({t["bg"] for t in after}) > 2
    assert min(contrast(t["bg"], t["fg"]) for t in after) >= 4.5
    assert "Projection" in js(driver, "return document.getElementById('legend').textContent")
    driver.find_elements("css selector", "#tokens .tok")[2].click()
    label = wait_for(
        lambda: js(
            driver,
            "const s = document.querySelector('#detail svg'); return s && s.getAttribute('aria-label')",
        ),
        timeout=15,
        what="the readout chart",
    )
    assert label.startswith("joy across layers: layer 0 ") and "layer 30" in label
    shot(driver, out_dir, "08-readouts")
    assert axe_serious(driver) == []
    assert severe_console(driver) == []


def test_phone_width_has_no_horizontal_overflow(browser: Any, server: str, out_dir: Path) -> None:
    driver = browser
    viewport(driver, 390, 844, mobile=True)
    try:
        driver.get(server + "/")
        wait_for_page(driver)
        generate(driver, prompt="A long line: " + "word " * 40, max_tokens=4)
        width = js(driver, "return window.innerWidth")
        assert width == 390
        assert js(driver, "return document.documentElement.scrollWidth") <= width
        shot(driver, out_dir, "09-phone")
        assert axe_serious(driver) == []
    finally:
        viewport(driver, 1280, 800)
    assert severe_console(driver) == []
