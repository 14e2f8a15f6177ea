"""The web playground's files over HTTP (tokenmill/server/playground.py): the page at `/`, its
scripts and styles with the content types a browser insists on, nothing else from disk, and
`--no-ui` turning it all off. What the page does is tested in a browser
(test_playground_browser.py)."""

from __future__ import annotations

import re

import httpx
import pytest

from tokenmill.cli import build_parser
from tokenmill.server.playground import static_files


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with server.http() as client:
        yield client


def test_the_root_serves_the_playground_page(http):
    page = http.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "<title>tokenmill playground</title>" in page.text


def test_every_file_the_page_loads_is_served_with_its_content_type(http):
    """The page's own references, and the modules' imports of each other, all resolve."""
    expected = {"css": "text/css; charset=utf-8", "js": "text/javascript; charset=utf-8"}
    seen, queue = set(), re.findall(r'(?:href|src)="/ui/([^"]+)"', http.get("/").text)
    assert {name.rsplit(".", 1)[1] for name in queue} == {"css", "js"}
    while queue:
        name = queue.pop()
        if name in seen:
            continue
        seen.add(name)
        asset = http.get(f"/ui/{name}")
        assert asset.status_code == 200, name
        assert asset.headers["content-type"] == expected[name.rsplit(".", 1)[1]]
        queue += re.findall(r'from "\./([^"]+)"', asset.text)
    assert seen == set(static_files()) - {"index.html"}


@pytest.mark.parametrize("name", ["nope.js", "..%2Fapp.py", "%2E%2E%2F__init__.py"])
def test_only_the_packaged_static_files_are_served(http, name):
    assert http.get(f"/ui/{name}").status_code == 404


def test_the_page_loads_no_third_party_resource(http):
    """Offline: every URL in the page and its files is the server's own."""
    texts = [http.get("/").text] + [http.get(f"/ui/{name}").text for name in static_files()]
    for text in texts:
        assert not re.search(r"(?:src|href)=\"(?:https?:)?//", text)
        assert not re.search(r"(?:from|import\(|fetch\()\s*[\"'`](?:https?:)?//", text)


def test_the_page_is_open_while_the_api_needs_a_key(start_server):
    with start_server(api_key="secret") as live:
        assert httpx.get(f"{live.url}/").status_code == 200
        assert httpx.get(f"{live.url}/ui/main.js").status_code == 200
        assert httpx.get(f"{live.url}/v1/metrics").status_code == 401


def test_without_the_ui_the_root_is_a_404_and_the_api_still_serves(start_server):
    with start_server(ui=False) as live:
        assert httpx.get(f"{live.url}/").status_code == 404
        assert httpx.get(f"{live.url}/ui/main.js").status_code == 404
        assert httpx.get(f"{live.url}/v1/models").status_code == 200


def test_serve_has_the_ui_on_unless_no_ui_is_given():
    parser = build_parser()
    assert parser.parse_args(["serve"]).ui is True
    assert parser.parse_args(["serve", "--no-ui"]).ui is False
