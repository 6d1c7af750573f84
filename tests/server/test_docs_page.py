"""GET /docs: the page works with nothing fetched from another host
(--enable-offline-docs), and --disable-fastapi-docs takes it away with the schema."""

from __future__ import annotations

import re

import pytest

from tests.server.test_app import fetch, serve

pytestmark = pytest.mark.usefixtures("no_api_key_env")


def test_the_docs_page_works_offline(server_loop, engine):
    """--enable-offline-docs (vLLM's, for air-gapped hosts) asks for what aioserve's page
    always is: nothing in it comes from another host."""
    with serve(server_loop, engine, "--enable-offline-docs") as served:
        page = fetch("GET", served.url + "/docs").body.decode()
        assert 'fetch("/openapi.json")' in page
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
        assert not re.search(r"""(fetch|import)\(\s*["'](https?:)?//""", page)


def test_docs_can_be_turned_off(server_loop, engine):
    with serve(server_loop, engine, "--disable-fastapi-docs") as served:
        assert fetch("GET", served.url + "/openapi.json").status == 404
        assert fetch("GET", served.url + "/docs").status == 404
