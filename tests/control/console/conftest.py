"""Fixtures of the console's browser tests: Debian's chromium, headless, through Selenium and
the system chromedriver; and where their screenshots go."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.required import unavailable

ARTIFACTS_ENV = "LORAPLANE_TEST_ARTIFACTS"


def chromium() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        unavailable("chromium", "apt-get install chromium chromium-driver (the console's "
                    "browser tests drive it headless)")
    try:
        import selenium  # noqa: F401  (the dev extra)
    except ImportError:
        unavailable("selenium", "pip install -e '.[dev]'")
    return browser, driver


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = os.environ.get(ARTIFACTS_ENV)
    out = Path(root) / "console" if root else tmp_path_factory.mktemp("console-screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture
def driver(tmp_path: Path) -> Iterator[Any]:
    browser, chromedriver = chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1400", f"--user-data-dir={tmp_path / 'chromium'}",
                "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(options=opts, service=Service(chromedriver))
    d.set_page_load_timeout(30)
    try:
        yield d
    finally:
        d.quit()


def wait_for(check: Callable[[], Any], timeout: float = 20.0, what: str = "") -> Any:
    # A page being navigated to, or a live fragment being replaced, has the element missing or
    # stale for a moment: that is "not yet", like a false check.
    from selenium.common.exceptions import (  # the dev extra: browser tests only
        NoSuchElementException,
        StaleElementReferenceException,
    )

    deadline = time.monotonic() + timeout
    while True:
        try:
            got = check()
        except (NoSuchElementException, StaleElementReferenceException):
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.1)


def shot(d: Any, path: Path) -> None:
    """A screenshot of the whole page, no taller than what it shows."""
    d.set_window_size(1280, 2400)  # measured at full size: a short window measures itself
    height = int(d.execute_script(
        "return Math.max(document.body.scrollHeight, document.body.offsetHeight)"))
    d.set_window_size(1280, min(max(height + 140, 360), 2400))  # + the browser's own bars
    d.save_screenshot(str(path))


def csp_violations(d: Any) -> list[str]:
    return [e["message"] for e in d.get_log("browser")
            if "Content Security Policy" in e.get("message", "")]
