"""The web page on ``serve`` (``GET /``), in a real browser: headless Chromium driven by Selenium
(:mod:`browser`).

References: the reply the page shows is the API's greedy reply to the same request; the marks,
the counts and the chart are the API's ``dspark_trace`` and ``timings`` for it; the slot is free
after Stop by ``/slots``; nothing in a hostile reply runs (the DOM says so).
"""

from __future__ import annotations

import json
import os
import re

import pytest

from browser import Page, browser_missing, chrome, console_errors, wait_for
from serve_helpers import SESSION, ServeProcess, sse_json

QUESTION = "List the planets of the solar system, one per line."
MAX_TOKENS = 48
HOSTILE = ('<script>window.__pwned = 1</script>\n\nSee <img src=x onerror="window.__pwned = 2"> here.\n\n'
           '**bold** `code` <a href="javascript:window.__pwned = 3">link</a> [md link](javascript:window.__pwned=4)')

_missing = browser_missing()
if _missing and os.environ.get("CI", "").lower() == "true":
    raise RuntimeError(f"CI needs a browser for the web page's tests: {_missing}")
pytestmark = pytest.mark.skipif(bool(_missing), reason=_missing or "")


@pytest.fixture(scope="module")
def server(target_path, tmp_path_factory):
    from pyllama_dspark.paths import default_draft

    srv = ServeProcess(target_path, default_draft(), tmp_path_factory.mktemp("webui") / "serve.log", n_ctx=2048,
                       extra=["--schedule", "off"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def page(server):
    drv = chrome()
    try:
        yield Page(drv, server.url).open()
    finally:
        drv.quit()


def api_reply(server, messages, max_tokens=MAX_TOKENS):
    """The API's greedy reply and its trace: (text, token marks, cycles, timings)."""
    r = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                                             "stream": True, "dspark_trace": True})
    chunks = [c for c in sse_json(r) if c != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    toks = [t for c in chunks if c.get("dspark_trace") for t in c["dspark_trace"]["tokens"]]
    cycles = [x for c in chunks if c.get("dspark_trace") for x in c["dspark_trace"]["cycles"]]
    return text, toks, cycles, chunks[-1]["timings"]


def ints(els, attr):
    return [int(e.get_attribute(attr)) for e in els]


def test_the_page_is_served_offline_and_switchable(server, target_path, tmp_path):
    r = SESSION.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assets = re.findall(r'(?:src|href)="(/webui/[^"]+)"', r.text)
    assert any(a.endswith(".js") for a in assets) and any(a.endswith(".css") for a in assets)
    for a in assets:
        body = SESSION.get(server.url + a)
        assert body.status_code == 200, a
    # nothing from elsewhere: no absolute URL is loaded by the page or its own scripts and styles
    own = [r.text] + [SESSION.get(server.url + a).text for a in assets if "/vendor/" not in a]
    for text in own:
        assert not re.search(r'(?:src|href)\s*=\s*["\']?(?:https?:)?//', text)
        assert not re.search(r'(?:fetch|import|url)\s*\(\s*["\']?(?:https?:)?//', text)
    assert SESSION.get(server.url + "/webui/../webui.py").status_code == 404
    assert SESSION.get(server.url + "/webui/nope.js").status_code == 404
    off = ServeProcess(target_path, None, tmp_path / "off.log", n_ctx=512, extra=["--no-webui"])
    try:
        assert off.get("/").status_code == 404
        assert off.get("/health").status_code == 200
    finally:
        off.stop()


def test_the_settings_default_to_the_servers(page, server):
    """The sampling defaults are the server's own (/props: this server runs with --temp 0)."""
    params = server.get("/props").json()["default_generation_settings"]["params"]
    page.one("#settings-btn").click()
    assert float(page.one("#temperature").get_attribute("value")) == params["temperature"] == 0
    assert float(page.one("#top-p").get_attribute("value")) == params["top_p"]
    assert page.one("#draft-on").is_selected()
    page.one("#settings-cancel").click()


def test_a_reply_its_marks_and_its_chart(page, server):
    page.settings(max_tokens=MAX_TOKENS, draft_on=True)
    page.send(QUESTION)
    msg = page.last_reply()
    text, toks, cycles, timings = api_reply(server, [{"role": "user", "content": QUESTION}])
    assert timings["draft_n_accepted"] > 0, "the test needs accepted drafts"
    # the streamed reply is the API's greedy reply: its raw text, token by token
    msg.find_element("css selector", ".spec-toggle").click()
    spans = wait_for(lambda: msg.find_elements("css selector", ".spec-view span.tok"), 30, "the speculation view")
    assert "".join(s.get_attribute("textContent") for s in spans) == text
    # marks: the accepted drafts are the trace's, and the trace's counts are the timings'
    drafts = [s for s in spans if s.get_attribute("data-source") == "draft"]
    assert len(drafts) == sum(1 for t in toks if t["source"] == "draft")
    assert sum(c["accepted"] for c in cycles) == timings["draft_n_accepted"]
    first = drafts[0]
    t0 = next(t for t in toks if t["source"] == "draft")
    assert (first.get_attribute("data-cycle"), first.get_attribute("data-pos")) == (str(t0["cycle"]), str(t0["pos"]))
    assert t0["cycle"] and str(t0["cycle"]) in first.get_attribute("title")
    # the numbers beside it are the timings' and the chart is the per-position law of the cycles
    stats = msg.find_element("css selector", ".spec-stats")
    assert int(stats.find_element("css selector", ".stat-drafted").text) == timings["draft_n"]
    assert int(stats.find_element("css selector", ".stat-accepted").text) == timings["draft_n_accepted"]
    assert float(stats.find_element("css selector", ".stat-tps").text) > 0
    bars = stats.find_elements("css selector", ".pos-bar")
    tried = [0] * 7
    acc = [0] * 7
    for c in cycles[1:]:
        for k in range(min(c["accepted"] + 1, c["verified"])):
            tried[k] += 1
        for k in range(c["accepted"]):
            acc[k] += 1
    got = {int(b.get_attribute("data-pos")): (int(b.get_attribute("data-tried")), int(b.get_attribute("data-accepted")))
           for b in bars}
    assert all(got.get(k, (0, 0)) == (tried[k], acc[k]) for k in range(7)), (got, tried, acc)
    assert sum(a for _, a in got.values()) == timings["draft_n_accepted"]
    cells = stats.find_elements("css selector", ".sched-cell")
    assert ints(cells, "data-verified") == [c["verified"] for c in cycles[1:]]
    tau = (timings["draft_n_accepted"] + len(cycles) - 1) / (len(cycles) - 1)
    assert abs(float(stats.find_element("css selector", ".stat-tau").text) - tau) < 0.006
    assert not console_errors(page.drv)


def test_compare_with_no_draft(page, server):
    msg = page.css('.msg[data-role="assistant"]')[0]
    msg.find_element("css selector", ".compare-btn").click()
    res = msg.find_element("css selector", ".compare-result")
    wait_for(lambda: res.get_attribute("data-state") == "done", 300, "the comparison")
    assert res.find_element("css selector", ".cmp-verdict").text.startswith("identical")
    assert float(res.find_element("css selector", ".cmp-draft-tps").text) > 0
    assert float(res.find_element("css selector", ".cmp-nodraft-tps").text) > 0


def test_conversations_persist_and_do_not_leak(page):
    n = len(page.css(".msg"))
    assert n >= 2
    page.open()   # a reload
    wait_for(lambda: len(page.css(".msg")) == n, 60, "the conversation after a reload")
    assert QUESTION in page.css('.msg[data-role="user"]')[0].text
    page.one("#new-chat").click()
    wait_for(lambda: not page.css(".msg"), 30, "an empty conversation")
    page.send("Say hello.", enter=False)
    items = page.css("#conv-list .conv-item")
    assert len(items) == 2
    first = next(i for i in items if "active" not in i.get_attribute("class"))
    first.find_element("css selector", ".conv-title").click()
    wait_for(lambda: len(page.css(".msg")) == n, 60, "the first conversation")
    assert not any("Say hello." in m.text for m in page.css(".msg"))
    # rename and delete (the page asks through prompt() / confirm())
    page.drv.execute_script("window.prompt = () => 'Planets'; window.confirm = () => true;")
    active = page.one("#conv-list .conv-item.active")
    active.find_element("css selector", ".conv-rename").click()
    wait_for(lambda: "Planets" in page.one("#conv-list .conv-item.active .conv-title").text, 30, "the new name")
    other = next(i for i in page.css("#conv-list .conv-item") if "active" not in i.get_attribute("class"))
    other.find_element("css selector", ".conv-delete").click()
    wait_for(lambda: len(page.css("#conv-list .conv-item")) == 1, 30, "the deletion")
    assert len(page.css(".msg")) == n


def test_stop_ends_the_stream_and_frees_the_slot(page, server):
    page.one("#new-chat").click()
    page.settings(max_tokens=-1)
    box = page.one("#input")
    page.drv.execute_script("arguments[0].value = arguments[1]", box, "Write a very long story about a dragon.")
    page.one("#send").click()
    wait_for(lambda: page.busy() and len(page.last_reply().find_element("css selector", ".msg-content").text) > 20,
             120, "the reply to stream")
    assert page.one("#stop").is_enabled()
    page.one("#stop").click()
    page.wait_idle(30)
    wait_for(lambda: not any(s["is_processing"] for s in server.get("/slots").json()), 30, "a free slot")
    assert page.last_reply().find_element("css selector", ".msg-content").text
    assert not page.last_reply().find_elements("css selector", ".msg-error")
    page.settings(max_tokens=MAX_TOKENS)


def test_a_hostile_reply_runs_nothing(page, tmp_path):
    """Model output reaches the DOM only through the sanitizer: a reply with a script and an
    onerror handler is shown, and runs nothing (an imported conversation, as the page stores it)."""
    conv = {"id": "hostile", "title": "hostile", "messages": [{"role": "user", "content": HOSTILE},
                                                               {"role": "assistant", "content": HOSTILE}]}
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps([conv]))
    page.one("#import-input").send_keys(str(path))
    item = wait_for(lambda: [i for i in page.css("#conv-list .conv-item") if "hostile" in i.text], 30, "the import")
    item[0].find_element("css selector", ".conv-title").click()
    wait_for(lambda: len(page.css(".msg")) == 2, 30, "the hostile conversation")
    assert page.drv.execute_script("return window.__pwned === undefined")
    assert not page.drv.execute_script("return document.querySelectorAll('#messages script').length")
    assert not page.drv.execute_script("return [...document.querySelectorAll('#messages *')]"
                                       ".filter(e => [...e.attributes].some(a => a.name.startsWith('on'))).length")
    reply = page.last_reply()
    assert reply.find_element("css selector", ".msg-content strong").text == "bold"   # Markdown rendered
    assert "<script>" in reply.find_element("css selector", ".msg-content").text      # raw HTML shown as text
    links = reply.find_elements("css selector", ".msg-content a")
    assert [a.text for a in links] == ["md link"]   # the Markdown link, its javascript: target removed
    for a in links:
        assert not (a.get_attribute("href") or "").startswith("javascript:")
    assert "<script>" in page.css('.msg[data-role="user"]')[0].text   # user text is text
    assert page.drv.execute_script("return window.__pwned === undefined")


def test_errors_show_in_the_page(page, server):
    page.one("#new-chat").click()
    page.settings(top_p=5)
    page.send("hi")
    err = page.last_reply().find_element("css selector", ".msg-error")
    assert "top_p" in err.text
    page.settings(top_p=0.95)
    page.send("word " * 3000)
    assert "context" in page.last_reply().find_element("css selector", ".msg-error").text.lower()


def test_api_key(target_path, tmp_path):
    srv = ServeProcess(target_path, None, tmp_path / "key.log", n_ctx=1024, extra=["--api-key", "s3cret"])
    drv = chrome()
    try:
        assert SESSION.get(srv.url + "/").status_code == 200
        assert SESSION.get(srv.url + "/v1/models").status_code == 401
        page = Page(drv, srv.url).open()
        dialog = page.one("#api-key-dialog")
        wait_for(lambda: dialog.is_displayed(), 60, "the key prompt")
        page.one("#api-key-input").send_keys("s3cret")
        page.one("#api-key-save").click()
        wait_for(lambda: not dialog.is_displayed(), 30, "the prompt to close")
        page.settings(max_tokens=8)
        page.send("Say hello.")
        assert page.last_reply().find_element("css selector", ".msg-content").text
        assert not page.last_reply().find_elements("css selector", ".msg-error")
        # the server gone: an error in the page, not a blank reply
        srv.stop()
        page.send("Still there?")
        assert page.last_reply().find_element("css selector", ".msg-error").text
    finally:
        drv.quit()
        srv.stop()


def test_regenerate_and_edit(page, server):
    """Regenerate at T = 0 gives the same greedy reply again; an edited message is sent again, the
    replies after it dropped, and its reply is the API's greedy reply to the edited conversation."""
    page.one("#new-chat").click()
    page.settings(max_tokens=24)
    page.send("Name three colors.")
    first = page.last_reply().find_element("css selector", ".msg-content").text
    page.last_reply().find_element("css selector", ".msg-regen").click()
    wait_for(lambda: page.busy() or page.last_reply().find_element("css selector", ".msg-content").text, 30, "regen")
    page.wait_idle()
    assert len(page.css(".msg")) == 2
    assert page.last_reply().find_element("css selector", ".msg-content").text == first
    user = page.css('.msg[data-role="user"]')[0]
    user.find_element("css selector", ".msg-edit").click()
    box = user.find_element("css selector", ".msg-edit-input")
    page.drv.execute_script("arguments[0].value = arguments[1]", box, "Name three animals.")
    user.find_element("css selector", ".msg-edit-send").click()
    wait_for(lambda: "Name three animals." in page.css('.msg[data-role="user"]')[0].text, 60, "the edited message")
    page.wait_idle()
    assert len(page.css(".msg")) == 2
    text, _, _, _ = api_reply(server, [{"role": "user", "content": "Name three animals."}], max_tokens=24)
    spans = None
    msg = page.last_reply()
    msg.find_element("css selector", ".spec-toggle").click()
    spans = wait_for(lambda: msg.find_elements("css selector", ".spec-view span.tok"), 30, "the speculation view")
    assert "".join(s.get_attribute("textContent") for s in spans) == text
    page.settings(max_tokens=MAX_TOKENS)


def test_export_then_import_gives_the_same_conversations(page, tmp_path):
    """Export all (the download's JSON, caught as the page makes it), delete everything, import the
    file: the same conversations, titles and messages come back."""
    page.drv.execute_script(
        "window.__exported = null; const orig = URL.createObjectURL;"
        "URL.createObjectURL = (b) => { b.text().then(t => { window.__exported = t; }); return orig(b); };")
    before = page.drv.execute_script("return localStorage.getItem('dspark.conversations')")
    page.one("#export-btn").click()
    exported = wait_for(lambda: page.drv.execute_script("return window.__exported"), 30, "the export")
    convs = json.loads(exported)["conversations"]
    assert [c["id"] for c in convs] == [c["id"] for c in json.loads(before)]
    page.drv.execute_script("window.confirm = () => true;")
    while page.css("#conv-list .conv-item"):
        n = len(page.css("#conv-list .conv-item"))
        page.css("#conv-list .conv-item")[0].find_element("css selector", ".conv-delete").click()
        wait_for(lambda: len(page.css("#conv-list .conv-item")) < n, 30, "a deletion")
    path = tmp_path / "export.json"
    path.write_text(exported)
    page.one("#import-input").send_keys(str(path))
    wait_for(lambda: len(page.css("#conv-list .conv-item")) == len(convs), 30, "the import")
    after = json.loads(page.drv.execute_script("return localStorage.getItem('dspark.conversations')"))
    key = lambda c: (c["id"], c["title"], [(m["role"], m["content"]) for m in c["messages"]])  # noqa: E731
    assert sorted(map(key, after)) == sorted(map(key, convs))
