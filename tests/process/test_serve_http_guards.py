"""The HTTP server's guards: the API key also covers the API's description (/docs, /redoc,
/openapi.json), and slow clients (headers or body dribbled in) are cut off after a timeout
while everyone else is served."""
import asyncio

import httpx
import pytest

from kvhold.serving.http_api import AppSettings, create_app

KEY = "sk-guards"
DESCRIPTION = ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect")


def _get_all(api_key, headers):
    app = create_app(AppSettings(endpoint="ipc:///nonexistent", model_dir=None, served_model_name="m",
                                 context_len=64, api_key=api_key))

    async def run():
        transport = httpx.ASGITransport(app=app)   # the description needs no sidecar
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return {p: (await client.get(p, headers=headers)) for p in DESCRIPTION}
    return asyncio.run(run())


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_the_api_description_needs_the_key_when_one_is_set(headers):
    for path, r in _get_all(KEY, headers).items():
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path


def test_the_api_description_is_served_with_the_key_or_without_one():
    for answers in (_get_all(KEY, {"Authorization": f"Bearer {KEY}"}), _get_all(None, {})):
        assert all(r.status_code == 200 for r in answers.values()), answers
        assert "/v1/completions" in answers["/openapi.json"].json()["paths"]
        assert "swagger" in answers["/docs"].text.lower() and "redoc" in answers["/redoc"].text.lower()
