"""The chat page at `/` (mlx_v41/server/web/). Fast: `/` and its assets are served with their
content types and outside the key check and the OpenAPI schema, nothing in them names another
host, the package ships them, and `--no-web` turns them off. Slow, in Debian's Chromium driven
by Playwright: the page loads with every request to its own server, streams a reply equal to
the server's greedy one, folds the reasoning, shows tool calls and model text as text, sends an
attached image as an image_url part, keeps the conversation across a reload until "New chat",
stops a reply (and its request), and asks for the API key (a wrong one, then the right one).

With MLX_V41_CHAT_SCREENSHOT=path the conversation test saves the page there (the picture in
docs/clients.md: `MLX_V41_CHAT_SCREENSHOT=docs/images/chat-page.png pytest
tests/test_web_page.py -k reload`).
"""

from __future__ import annotations

import base64
import fnmatch
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest

import mlx_v41
from conftest import reference_ops
from mlx_v41.cli.server import setup_arg_parser
from mlx_v41.server.web import routes as web
from server_harness import MODEL_ID, CliServer, Forcing, LiveServer, call, post, tiny
from vision_fixtures import IMAGES, SMALL_MIN_PIXELS, vision_checkpoint

pytestmark = pytest.mark.usefixtures("cpu")

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")  # Debian's; Playwright downloads no browser here
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SCREENSHOT = os.environ.get("MLX_V41_CHAT_SCREENSHOT")
KEY = "sk-web-test"
MAX_TOKENS = 24  # of a greedy reply of the random model
FORCED_TOKENS = 300  # room for a forced reply (the DSML call takes 175)
REPLY_SECONDS = 120  # the longest wait for one reply on a slow shared CPU
VECTORS = json.loads((REPO / "tests" / "data" / "chat_vectors.json").read_text("utf-8"))


# ----------------------------------------------------------------------------- fast checks

@pytest.fixture(scope="module")
def keyed():
    """A tiny server with an API key (the page's files must load without it)."""
    server = LiveServer(*tiny(), api_keys=[KEY])
    yield server
    server.close()


def test_root_serves_the_page_and_its_assets(keyed):
    expected = {"/": "text/html", "/web/app.js": "text/javascript",
                "/web/style.css": "text/css"}
    for path, media_type in expected.items():
        status, headers, body = call(keyed.port, "GET", path)
        assert status == 200, (path, body)
        assert headers["content-type"] == f"{media_type}; charset=utf-8"
        assert "connect-src 'self'" in headers["content-security-policy"]
        assert headers["x-content-type-options"] == "nosniff"
    assert '<script src="web/app.js"></script>' in call(keyed.port, "GET", "/")[2]
    assert call(keyed.port, "GET", "/v1/models")[0] == 401  # the API still needs the key
    assert call(keyed.port, "GET", "/web/other.js")[0] == 401  # an unknown path too


def test_the_page_is_not_in_the_openapi_schema(keyed):
    status, _, spec = call(keyed.port, "GET", "/openapi.json",
                           headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200
    assert not any(path == "/" or path.startswith("/web") for path in spec["paths"])


def test_the_static_files_name_no_other_host():
    files = {p.name: p.read_text("utf-8") for p in web.STATIC.iterdir()}
    assert sorted(files) == ["app.js", "index.html", "style.css"]
    for name, text in files.items():
        assert not re.search(r"https?:|//[a-z0-9-]+\.[a-z]", text, re.I), name
        assert "@import" not in text and "url(" not in text, name
    # model text reaches the page as textContent only
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(",
                         files["app.js"])
    assert re.findall(r'(?:src|href)="([^"]+)"', files["index.html"]) == \
        ["data:,", "web/style.css", "web/app.js"]


def test_the_package_ships_the_static_files():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "mlx_v41.server.web" in setuptools["packages"]
    patterns = setuptools["package-data"]["mlx_v41.server.web"]
    for path in web.STATIC.iterdir():
        name = path.relative_to(web.STATIC.parent).as_posix()
        assert any(fnmatch.fnmatch(name, p) for p in patterns), name


def test_no_web_turns_the_page_off():
    parser = setup_arg_parser()
    assert parser.parse_args(["--model", "x"]).web
    assert not parser.parse_args(["--model", "x", "--no-web"]).web
    server = LiveServer(*tiny(), web=False)
    try:
        assert call(server.port, "GET", "/")[0] == 404
        assert call(server.port, "GET", "/web/app.js")[0] == 404
        assert call(server.port, "GET", "/health")[0] == 200
    finally:
        server.close()


@pytest.mark.slow
def test_the_cli_no_web_flag_gives_404_at_root():
    server = CliServer("--no-web")
    try:
        server.ready()
        assert call(server.port, "GET", "/")[0] == 404
    finally:
        server.kill()


# ----------------------------------------------------------------------------- the browser

class ByMessage(Forcing):
    """`Forcing` keyed by the last user message's text (the page sends no `user`)."""

    def __call__(self, request, prompt):
        content = request.messages[-1].content
        text = content if isinstance(content, str) else \
            "".join(part.text or "" for part in content if part.type == "text")
        return super().__call__(SimpleNamespace(user=text), prompt)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The vision golden (images' spans kept small) behind a server whose replies the tests
    force by message."""
    folder = vision_checkpoint(tmp_path_factory.mktemp("vision") / "hf", SMALL_MIN_PIXELS)
    model, tokenizer = mlx_v41.load(folder, dspark=False)
    server = LiveServer(reference_ops(model), tokenizer, hook=ByMessage(tokenizer))
    yield server
    server.close()


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian's `chromium` package; .ci/run "
                    "installs it)")
    playwright = pytest.importorskip("playwright.sync_api",
                                     reason="Playwright is in the [test] extra")
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class Page:
    """One tab on the chat page of `server`, in a fresh profile, recording its requests."""

    def __init__(self, browser, server):
        self.server = server
        self.context = browser.new_context(viewport={"width": 1180, "height": 820})
        self.tab = self.context.new_page()
        self.tab.set_default_timeout(REPLY_SECONDS * 1000)
        self.requests: list = []
        self.tab.on("request", lambda request: self.requests.append(request))
        self.errors: list = []  # script errors, and console errors (a CSP violation logs one)
        self.tab.on("pageerror", lambda e: self.errors.append(str(e)))
        self.tab.on("console", lambda m: self.errors.append(m.text) if m.type == "error" and
                    "status of 401" not in m.text else None)  # the key test's 401s are meant
        self.tab.goto(f"http://127.0.0.1:{server.port}/")

    def wait_for_model(self) -> None:
        self.tab.locator(f"#model:text-is('{MODEL_ID}')").wait_for()

    def settings(self, thinking: bool, temperature="0", max_tokens=str(MAX_TOKENS)) -> None:
        self.tab.set_checked("#thinking", thinking)
        self.tab.fill("#temperature", temperature)
        self.tab.fill("#max-tokens", max_tokens)

    def send(self, text: str):
        """Send `text`; the reply's locator once it is done."""
        replies = self.tab.locator(".message.assistant")
        before = replies.count()
        self.tab.fill("#prompt", text)
        self.tab.click("#send")
        reply = replies.nth(before)
        reply.and_(self.tab.locator("[data-state=done]")).wait_for()
        return reply

    def chat_bodies(self) -> list:
        return [r.post_data_json for r in self.requests if r.url.endswith("/chat/completions")]

    def hosts(self) -> set:
        return {urlsplit(r.url).netloc for r in self.requests
                if urlsplit(r.url).scheme not in ("data", "blob")}

    def close(self) -> None:
        assert self.errors == []
        self.context.close()


@pytest.fixture
def page(browser, live):
    tab = Page(browser, live)
    yield tab
    tab.close()


def text_of(locator) -> str:
    return locator.text_content() if locator.count() else ""


def greedy_reply(live, body: dict) -> dict:
    status, reply = post(live.port, "/v1/chat/completions", dict(body, stream=False,
                                                                 stream_options=None))
    assert status == 200, reply
    return reply


@pytest.mark.slow
def test_the_page_loads_from_its_server_alone(page):
    page.wait_for_model()
    assert page.tab.title() == "mlx_v41 chat"
    assert page.hosts() == {f"127.0.0.1:{page.server.port}"}
    assert {urlsplit(r.url).path for r in page.requests} >= \
        {"/", "/web/app.js", "/web/style.css", "/v1/models"}


@pytest.mark.slow
def test_a_streamed_reply_equals_the_servers_greedy_reply(page):
    page.wait_for_model()
    page.settings(thinking=False)
    page.tab.evaluate("""() => {
        window.mutations = 0;
        new MutationObserver((list) => { window.mutations += list.length; })
            .observe(document.getElementById('messages'),
                     {childList: true, subtree: true, characterData: true});
    }""")
    reply = page.send("Hello")
    [body] = page.chat_bodies()
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["max_tokens"] == MAX_TOKENS
    assert body["chat_template_kwargs"] == {"thinking": False}
    assert body["messages"] == [{"role": "user", "content": "Hello"}]
    expected = greedy_reply(page.server, body)
    message, usage = expected["choices"][0]["message"], expected["usage"]
    assert message["content"] and text_of(reply.locator(".content")) == message["content"]
    assert reply.locator("details.reasoning").count() == 0
    assert page.tab.evaluate("window.mutations") > 4  # it came in pieces
    stats = text_of(reply.locator(".stats"))
    assert f"{usage['completion_tokens']} tokens" in stats and "tok/s" in stats
    assert re.search(rf"prompt {usage['prompt_tokens']} tokens, \d+ cached", stats), stats
    assert page.hosts() == {f"127.0.0.1:{page.server.port}"}


@pytest.mark.slow
def test_reasoning_is_folded_and_model_text_stays_text(page):
    answer = "Hi! <b>bold</b> & <script>window.bad = 1</script>"
    page.server.hook.add("Think first", f"Let me see.</think>{answer}")
    page.wait_for_model()
    page.settings(thinking=True, temperature="", max_tokens=str(FORCED_TOKENS))
    page.tab.select_option("#effort", "high")
    page.tab.fill("#stop-strings", "never said\nnor this")
    reply = page.send("Think first")
    [body] = page.chat_bodies()
    assert body["reasoning_effort"] == "high" and "temperature" not in body
    assert body["stop"] == ["never said", "nor this"]
    reasoning = reply.locator("details.reasoning")
    assert reasoning.get_attribute("open") is None and text_of(reasoning.locator("summary")) \
        == "Reasoning"
    assert not reasoning.locator("pre").is_visible()
    reasoning.locator("summary").click()
    assert reasoning.locator("pre").is_visible()
    assert text_of(reasoning.locator("pre")) == "Let me see."
    assert text_of(reply.locator(".content")) == answer
    assert reply.locator("b, script").count() == 0
    assert page.tab.evaluate("window.bad") is None


def _tool_call_text() -> str:
    """The official vector's generated turn: reasoning, then a get_weather DSML call."""
    case = next(c for c in VECTORS["cases"] if c["name"] == "thinking_tools_roundtrip")
    prompt, opening = case["prompt"], "<｜Assistant｜><think>"
    start = prompt.index(opening) + len(opening)
    return prompt[start:prompt.index("<｜end▁of▁sentence｜>", start)]


@pytest.mark.slow
def test_an_attached_image_goes_as_an_image_url_part(page):
    page.wait_for_model()
    page.settings(thinking=False)
    page.tab.set_input_files("#image-input", str(IMAGES[0]))
    page.tab.locator("#attachments img").wait_for()
    reply = page.send("What is in the image?")
    [body] = page.chat_bodies()
    [image, text] = body["messages"][-1]["content"]
    assert text == {"type": "text", "text": "What is in the image?"}
    assert image["type"] == "image_url"
    prefix = "data:image/png;base64,"
    assert image["image_url"]["url"].startswith(prefix)
    assert base64.b64decode(image["image_url"]["url"][len(prefix):]) == IMAGES[0].read_bytes()
    assert page.tab.locator("#attachments img").count() == 0
    assert page.tab.locator(".message.user img").get_attribute("src") == image["image_url"]["url"]
    expected = greedy_reply(page.server, body)
    assert text_of(reply.locator(".error")) == ""
    assert text_of(reply.locator(".content")) == expected["choices"][0]["message"]["content"]
    assert f"prompt {expected['usage']['prompt_tokens']} tokens" in \
        text_of(reply.locator(".stats"))


@pytest.mark.slow
def test_a_conversation_with_an_image_and_a_tool_call_survives_a_reload(page):
    page.server.hook.add("What is in this picture?",
                         "A two-colour picture.</think>A small picture: a block of colour on "
                         "a plain background.")
    page.server.hook.add("Weather in Paris for 2 days?", _tool_call_text())
    page.wait_for_model()
    page.settings(thinking=True, max_tokens=str(FORCED_TOKENS))
    page.tab.set_input_files("#image-input", str(IMAGES[1]))
    page.tab.locator("#attachments img").wait_for()
    first = page.send("What is in this picture?")
    second_reply = page.send("Weather in Paris for 2 days?")
    [call_block] = second_reply.locator(".tool-call").all()
    assert text_of(call_block.locator(".name")) == "tool call: get_weather"
    assert json.loads(text_of(call_block.locator(".arguments"))) == {"city": "Paris", "days": 2}
    assert "tool_calls" in text_of(second_reply.locator(".stats"))
    [_, second] = page.chat_bodies()
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert second["messages"][1]["reasoning_content"] == "A two-colour picture."
    shown = text_of(page.tab.locator("#messages"))
    first_stats = text_of(first.locator(".stats"))

    page.tab.reload()
    page.wait_for_model()
    assert text_of(page.tab.locator("#messages")) == shown
    assert text_of(page.tab.locator(".message.assistant").first.locator(".stats")) == first_stats
    assert page.tab.locator(".message.user img").count() == 1
    assert page.tab.is_checked("#thinking") and page.tab.input_value("#max-tokens") == \
        str(FORCED_TOKENS)
    if SCREENSHOT:  # the first reply's reasoning unfolded, the second's folded
        page.tab.locator("details.reasoning summary").first.click()
        page.tab.locator("#prompt").fill("Thanks! And tomorrow?")
        page.tab.screenshot(path=SCREENSHOT)

    page.tab.click("#new-chat")
    assert page.tab.locator(".message").count() == 0
    assert page.tab.evaluate("localStorage.getItem('mlx_v41.conversation')") is None
    page.tab.reload()
    page.wait_for_model()
    assert page.tab.locator(".message").count() == 0


@pytest.mark.slow
def test_stop_ends_the_reply_and_its_request(page):
    page.server.hook.add("Count", " ".join(str(i) for i in range(200)))
    page.wait_for_model()
    page.settings(thinking=False, max_tokens=str(FORCED_TOKENS))
    page.tab.fill("#prompt", "Count")
    page.tab.click("#send")
    reply = page.tab.locator(".message.assistant")
    reply.locator(".content").wait_for()  # the first text came
    page.tab.click("#stop")
    reply.and_(page.tab.locator("[data-state=done]")).wait_for()
    assert text_of(reply.locator(".stats")) == "stopped"
    assert page.tab.is_enabled("#send") and not page.tab.is_visible("#stop")
    assert page.server.wait_idle()  # the server ended the request
    shown = text_of(reply.locator(".content"))
    assert shown and "199" not in shown


@pytest.mark.slow
def test_the_page_asks_for_the_api_key(browser, keyed):
    page = Page(browser, keyed)
    dialog, error = page.tab.locator("#key-dialog"), page.tab.locator("#key-error")
    dialog.wait_for()
    assert not error.is_visible()
    page.tab.fill("#key-input", "sk-wrong")
    page.tab.click("#key-form button[type=submit]")
    error.wait_for()
    assert dialog.is_visible()
    page.tab.fill("#key-input", KEY)
    page.tab.click("#key-form button[type=submit]")
    page.wait_for_model()
    assert not dialog.is_visible()
    assert page.tab.evaluate("localStorage.getItem('mlx_v41.api_key')") == KEY
    page.settings(thinking=False, max_tokens="4")
    reply = page.send("Hello")
    assert text_of(reply.locator(".error")) == "" and text_of(reply.locator(".stats"))
    [chat] = [r for r in page.requests if r.url.endswith("/chat/completions")]
    assert chat.all_headers()["authorization"] == f"Bearer {KEY}"
    page.close()
