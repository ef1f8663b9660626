"""A headless Chromium driven over the DevTools protocol, to open a report as a person would.

The protocol runs over a pipe (``--remote-debugging-pipe``: JSON messages ended by a NUL byte
on file descriptors 3 and 4 of the browser), so it needs no port and no package beyond the
standard library: Debian's ``chromium`` is all. A page session collects what a person would
see in the developer console (exceptions, console errors, failed loads) and every request the
page makes.

Also a script, for the screenshots in docs/:
    .venv/bin/python tests/browser.py REPORT.html OUT.png [--width 1400] [--height 1000]
        [--full] [--scroll-to ID] [--fragment ID]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
# As root Chromium needs --no-sandbox; the rest keep it from reaching the network on its own.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio",
         "--remote-debugging-pipe")
OWN_SCHEMES = ("file:", "data:", "about:", "blob:")  # what a self-contained page may load


class BrowserError(Exception):
    pass


class Chromium:
    """One headless browser with a fresh profile; ``open`` gives a page session."""

    def __init__(self, executable: str = CHROMIUM, timeout_s: float = 60) -> None:
        self.timeout_s = timeout_s
        self.profile = tempfile.mkdtemp(prefix="kvtrace-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # The browser reads commands on fd 3 and writes replies on fd 4 (bash: dash refuses
        # descriptors above 9 in a redirection).
        self.process = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{to_browser_r} 4>&{from_browser_w}', "bash", executable,
             *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            pass_fds=(to_browser_r, from_browser_w), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.profile, "stderr"), "wb"))
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self._events: queue.Queue = queue.Queue()
        self._arrived = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buffer = b""
        with os.fdopen(self._from_browser, "rb", buffering=0) as pipe:
            while chunk := pipe.read(1 << 16):
                buffer += chunk
                *messages, buffer = buffer.split(b"\0")
                for message in messages:
                    decoded = json.loads(message)
                    if "id" in decoded:
                        with self._arrived:
                            self._replies[decoded["id"]] = decoded
                            self._arrived.notify_all()
                    else:
                        self._events.put(decoded)
        with self._arrived:
            self._arrived.notify_all()

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._next_id += 1
        number = self._next_id
        message = {"id": number, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout_s
        with self._arrived:
            while number not in self._replies:
                if not self._reader.is_alive() or time.monotonic() > deadline:
                    raise BrowserError(f"no reply to {method}; Chromium said: {self.stderr()}")
                self._arrived.wait(0.5)
            reply = self._replies.pop(number)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def stderr(self) -> str:
        """The end of what the browser wrote to its stderr."""
        try:
            with open(os.path.join(self.profile, "stderr"), "rb") as file:
                return file.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def events(self) -> list[dict]:
        """Events that arrived since the last call."""
        found = []
        while not self._events.empty():
            found.append(self._events.get())
        return found

    def open(self, path: str | os.PathLike, width: int = 1400, height: int = 1000,
             fragment: str = "") -> Page:
        """A new page showing the file at ``path`` (at ``#fragment``), once loaded."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target,
                                                      "flatten": True})["sessionId"]
        page = Page(self, session)
        for domain in ("Runtime", "Log", "Page", "Network"):
            self.send(f"{domain}.enable", session=session)
        self.send("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            session=session)
        url = Path(path).resolve().as_uri() + (f"#{fragment}" if fragment else "")
        self.send("Page.navigate", {"url": url}, session=session)
        page.wait_for_event("Page.loadEventFired")
        return page

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (BrowserError, OSError):  # already gone
            pass
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._to_browser)
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Page:
    """A page session: its console problems, the URLs it requested, evaluation, screenshots."""

    def __init__(self, browser: Chromium, session: str) -> None:
        self.browser, self.session = browser, session
        self.seen: list[dict] = []

    def _collect(self) -> None:
        self.seen += [e for e in self.browser.events() if e.get("sessionId") == self.session]

    def wait_for_event(self, method: str) -> None:
        deadline = time.monotonic() + self.browser.timeout_s
        while not any(e["method"] == method for e in self.seen):
            if time.monotonic() > deadline:
                raise BrowserError(f"the page never sent {method}")
            time.sleep(0.05)
            self._collect()

    def evaluate(self, expression: str):
        result = self.browser.send("Runtime.evaluate", {
            "expression": expression, "returnByValue": True, "awaitPromise": True},
            session=self.session)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_until(self, expression: str) -> None:
        deadline = time.monotonic() + self.browser.timeout_s
        while not self.evaluate(expression):
            if time.monotonic() > deadline:
                raise BrowserError(f"never true: {expression}")
            time.sleep(0.1)

    def console_errors(self) -> list[str]:
        """Uncaught exceptions, console.error/assert calls and error log entries (a resource
        that failed to load, say), as the console would show them."""
        self._collect()
        errors = []
        for event in self.seen:
            params = event.get("params", {})
            if event["method"] == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                errors.append(details.get("exception", {}).get("description")
                              or details.get("text", "exception"))
            elif (event["method"] == "Runtime.consoleAPICalled"
                  and params.get("type") in ("error", "assert")):
                errors.append(" ".join(str(a.get("value", a.get("description", "")))
                                       for a in params.get("args", [])))
            elif event["method"] == "Log.entryAdded" and params["entry"]["level"] == "error":
                errors.append(f"{params['entry'].get('url', '')}: {params['entry']['text']}")
        return errors

    def requested_urls(self) -> list[str]:
        self._collect()
        return [e["params"]["request"]["url"] for e in self.seen
                if e["method"] == "Network.requestWillBeSent"]

    def foreign_requests(self) -> list[str]:
        """Requests for anything the file does not hold: the network."""
        return [url for url in self.requested_urls() if not url.startswith(OWN_SCHEMES)]

    def screenshot(self, path: str | os.PathLike, *, full_page: bool = False) -> None:
        params: dict = {"format": "png"}
        if full_page:
            size = self.browser.send("Page.getLayoutMetrics",
                                     session=self.session)["cssContentSize"]
            params.update(captureBeyondViewport=True, clip={
                "x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1})
        data = self.browser.send("Page.captureScreenshot", params, session=self.session)["data"]
        import base64

        Path(path).write_bytes(base64.b64decode(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("png")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1000)
    parser.add_argument("--full", action="store_true", help="the whole page, not the viewport")
    parser.add_argument("--scroll-to", metavar="ID", help="an element to scroll to first")
    parser.add_argument("--fragment", default="", help="open the page at #FRAGMENT")
    args = parser.parse_args()
    with Chromium() as browser:
        page = browser.open(args.report, args.width, args.height, args.fragment)
        page.wait_until("document.querySelectorAll('.kvtrace-plot:not([data-rendered])')"
                        ".length === 0")
        if args.scroll_to:
            page.evaluate(f"document.getElementById({json.dumps(args.scroll_to)})"
                          ".scrollIntoView(); window.scrollBy(0, -70)")  # with its heading
        page.screenshot(args.png, full_page=args.full)
        for problem in page.console_errors() + page.foreign_requests():
            print(f"problem: {problem}")


if __name__ == "__main__":
    main()
