"""The documentation site (issue 34, item 5), built and read in a real browser.

``mkdocs build --strict`` (what ``make docs`` runs) builds the site into a temporary
folder: any warning (a broken link, a page missing from the nav, an unknown anchor)
fails it. The site is then served on 127.0.0.1 and read by a headless Chromium (Debian's
``chromium`` and ``chromium-driver``, driven by selenium):

* every page loads with no SEVERE entry in the browser's console;
* every internal link of every page, as the browser resolves it, names a built page, and
  its anchor, if any, an element of that page;
* the search box, given a hook's name, lists the generated hook reference.
"""

from __future__ import annotations

import functools
import http.server
import re
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage")
HOOK = "wrap_model"


def build_site(out: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Iterator[tuple[Path, str]]:
    """The built site's folder and the URL it is served at."""
    root = tmp_path_factory.mktemp("docs") / "site"
    build_site(root)
    handler = functools.partial(QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    assert Path(CHROMIUM).is_file() and Path(CHROMEDRIVER).is_file(), (
        "the browser test needs Debian's chromium and chromium-driver: "
        "apt-get install -y chromium chromium-driver (make test does it where apt-get exists)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def pages(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.html"))


def ids(html: str) -> set[str]:
    return set(re.findall(r'\sid="([^"]+)"', html))


@pytest.mark.slow
def test_the_site_builds_strictly_and_every_page_loads_and_links_in_chromium(site, browser):
    root, base = site
    built = pages(root)
    for page in ("index.html", "reference/hook-specs.html", "reference/cli.html",
                 "tutorials/first-run.html", "tutorials/porting-lightning.html",
                 "tutorials/nanogpt.html", "tutorials/multi-node.html",
                 "explanation/architecture.html", "decisions.html", "errors.html"):
        assert page in built, f"{page} was not built: {built}"
    anchors = {page: ids((root / page).read_text()) for page in built}
    errors, broken = [], []
    for page in built:
        browser.get(base + page)
        assert browser.execute_script("return document.readyState") == "complete", page
        title = browser.title
        assert title and "404" not in title or page == "404.html", (page, title)
        errors += [(page, entry["message"]) for entry in browser.get_log("browser")
                   if entry["level"] == "SEVERE"]
        hrefs = browser.execute_script(
            "return Array.from(document.querySelectorAll('a[href]'), a => a.href)")
        for href in hrefs:
            if not href.startswith(base):
                continue  # outside the site (pluggy's documentation, the theme's links)
            url = urllib.parse.urlsplit(href)
            target = urllib.parse.unquote(url.path[1:]) or "index.html"
            if target.endswith("/"):
                target += "index.html"
            if target not in anchors:
                if not (root / target).is_file():  # an asset (search index, sitemap)
                    broken.append((page, href))
            elif url.fragment and urllib.parse.unquote(url.fragment) not in anchors[target]:
                broken.append((page, href))
    assert errors == [], errors
    assert broken == [], broken
    assert len(built) >= 30


@pytest.mark.slow
def test_searching_a_hook_name_lists_the_hook_reference(site, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    _, base = site
    browser.get(base + "index.html")
    wait = WebDriverWait(browser, 30)
    opener = (By.CSS_SELECTOR, "label.md-search__icon, label[for='__search']")
    wait.until(expected_conditions.element_to_be_clickable(opener)).click()
    search = (By.CSS_SELECTOR, "input.md-search__input")
    box = wait.until(expected_conditions.visibility_of_element_located(search))
    box.send_keys(HOOK)

    def results(driver):
        links = driver.find_elements(By.CSS_SELECTOR, ".md-search-result__item a")
        return [a.get_attribute("href") for a in links] or False

    found = WebDriverWait(browser, 60).until(results)
    assert any("reference/hook-specs.html" in href for href in found), found
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
