"""A real browser for the web page's tests and screenshots: Debian's ``chromium`` driven through
``chromedriver`` by Selenium, headless.

Selenium gets ``/usr/bin/chromedriver`` explicitly (otherwise its manager tries to download a
driver), and Chromium runs with ``--no-sandbox`` (CI runs as root).  Without a browser the tests
skip, except under ``CI=true``, where they fail (``.ci/run`` installs both).
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Callable, List, Optional

CHROMEDRIVER = "/usr/bin/chromedriver"


def browser_missing() -> Optional[str]:
    """Why no browser can run here (None: it can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install '.[test]')"
    if not os.path.exists(CHROMEDRIVER):
        return f"{CHROMEDRIVER} is missing (apt-get install chromium chromium-driver)"
    if not (shutil.which("chromium") or os.path.exists("/usr/bin/chromium")):
        return "chromium is missing (apt-get install chromium)"
    return None


def chrome(width: int = 1280, height: int = 900):
    """A headless Chromium (its console log kept: :func:`console_errors`)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    # on a 2-core machine whose other test worker keeps llama.cpp's threads busy, a starved renderer
    # must not be throttled as a background one, and a navigation waits for the DOM only
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--disable-renderer-backgrounding", "--disable-background-timer-throttling",
              "--disable-backgrounding-occluded-windows", f"--window-size={width},{height}", "--lang=en-US"):
        opts.add_argument(a)
    opts.page_load_strategy = "eager"
    opts.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    drv.set_page_load_timeout(180)
    return drv


def wait_for(cond: Callable[[], object], timeout: float = 60.0, what: str = "a condition", poll: float = 0.1):
    """``cond()``'s first truthy value within ``timeout`` seconds, else AssertionError."""
    deadline = time.monotonic() + timeout
    last_err = None
    while time.monotonic() < deadline:
        try:
            v = cond()
            if v:
                return v
        except Exception as e:   # a stale element while the page re-renders: try again
            last_err = e
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}" + (f" ({last_err})" if last_err else ""))


def console_errors(drv) -> List[str]:
    """The page's console errors since the last call."""
    return [e["message"] for e in drv.get_log("browser") if e.get("level") == "SEVERE"]


class Page:
    """The web page of one ``serve``, by its DOM contract (ids and classes that docs/serve.md names)."""

    def __init__(self, drv, url: str):
        self.drv, self.url = drv, url

    def css(self, sel: str):
        from selenium.webdriver.common.by import By

        return self.drv.find_elements(By.CSS_SELECTOR, sel)

    def one(self, sel: str):
        els = wait_for(lambda: self.css(sel), 30, sel)
        return els[0]

    def open(self, tries: int = 3) -> "Page":
        """Load the page (again): a navigation that times out in a starved renderer is tried again."""
        from selenium.common.exceptions import TimeoutException

        for i in range(tries):
            try:
                self.drv.get(self.url + "/")
                break
            except TimeoutException:
                if i == tries - 1:
                    raise
        wait_for(lambda: self.css("#input") and self.css("#messages"), 120, "the page")
        return self

    def busy(self) -> bool:
        return self.one("#messages").get_attribute("data-busy") == "1"

    def send(self, text: str, *, enter: bool = True, timeout: float = 300.0) -> None:
        """Type ``text`` into the box and send it (Enter, or the Send button); wait for the reply's end."""
        from selenium.webdriver.common.keys import Keys

        box = self.one("#input")
        box.clear()
        self.drv.execute_script("arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('input'))",
                                box, text)
        n = len(self.css('.msg[data-role="assistant"]'))
        if enter:
            box.send_keys(Keys.ENTER)
        else:
            self.one("#send").click()
        wait_for(lambda: len(self.css('.msg[data-role="assistant"]')) > n, 30, "the reply to start")
        self.wait_idle(timeout)

    def wait_idle(self, timeout: float = 300.0) -> None:
        wait_for(lambda: not self.busy(), timeout, "the reply to end")

    def last_reply(self):
        return self.css('.msg[data-role="assistant"]')[-1]

    def settings(self, **values) -> None:
        """Open the settings, set ``system_prompt``, ``temperature``, ``top_p``, ``max_tokens``
        (text values) and ``draft_on`` (bool), save."""
        self.one("#settings-btn").click()
        for k, v in values.items():
            el = self.one("#" + k.replace("_", "-"))
            if isinstance(v, bool):
                if el.is_selected() != v:
                    el.click()
            else:
                self.drv.execute_script("arguments[0].value = arguments[1];"
                                        "arguments[0].dispatchEvent(new Event('input'));"
                                        "arguments[0].dispatchEvent(new Event('change'))", el, str(v))
        self.one("#settings-save").click()
