"""Screenshots of the web page (``serve``'s ``GET /``), taken with the tests' browser harness
(``tests/browser.py``: headless Chromium through Selenium).

    python tools/webui_screenshot.py [--out docs/images] [-m TARGET] [-md DRAFT]

Starts ``serve`` on the default models (SmolLM2-135M-Instruct and the shipped drafter, every
block verified), asks one question, and saves ``webui-speculation.png`` (the reply in its
speculation view, with the chart) and ``webui-chat.png`` (the rendered reply).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from browser import Page, chrome, wait_for  # noqa: E402
from serve_helpers import ServeProcess  # noqa: E402

QUESTION = "Write a short Python function that returns the squares of a list, and explain it in one sentence."


def main() -> None:
    from pyllama_dspark.cli.common import default_target
    from pyllama_dspark.paths import default_draft

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "images"))
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-md", "--model-draft", default=None)
    ap.add_argument("--max-tokens", type=int, default=96)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        srv = ServeProcess(a.model or default_target(), a.model_draft or default_draft(), Path(d) / "serve.log",
                           n_ctx=2048, extra=["--schedule", "off"])
        drv = chrome(1360, 1000)
        try:
            page = Page(drv, srv.url).open()
            page.settings(max_tokens=a.max_tokens)
            page.send(QUESTION)
            wait_for(lambda: not page.one("#toast").is_displayed(), 20, "the notice to go")
            drv.save_screenshot(str(out / "webui-chat.png"))
            msg = page.last_reply()
            msg.find_element("css selector", ".spec-toggle").click()
            wait_for(lambda: msg.find_elements("css selector", ".spec-view span.tok"), 10, "the speculation view")
            drv.execute_script("arguments[0].scrollIntoView({block: 'start'})", msg)
            drv.save_screenshot(str(out / "webui-speculation.png"))
        finally:
            drv.quit()
            srv.stop()
    print(f"wrote {out / 'webui-chat.png'} and {out / 'webui-speculation.png'}")


if __name__ == "__main__":
    main()
