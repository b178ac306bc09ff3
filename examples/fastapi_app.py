"""Use kvhold from your own FastAPI app with the asyncio SDK (kvhold.client.aclient.AsyncClient).

    kvhold sidecar --model DIR --instance main &            # or: kvhold serve ... (also starts one)
    KVHOLD_INSTANCE=main python examples/fastapi_app.py --port 8080
    curl -s localhost:8080/generate -d '{"prompt": "Once upon a time", "max_tokens": 16}'
    curl -sN localhost:8080/stream -d '{"prompt": "Once upon a time", "max_tokens": 16}'

One AsyncClient (one ZeroMQ socket) serves every request of the app; each request is
one stream. If the sidecar's active executor crashes, the streams pause for a few
milliseconds and continue token for token: the app needs no retry logic. A sidecar
that stays silent raises SidecarUnavailable, answered here with a 503.
"""
from __future__ import annotations

import argparse
import json
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvhold.client.aclient import AsyncClient
from kvhold.protocol.errors import InvalidParams, KvholdError, SidecarUnavailable


@asynccontextmanager
async def lifespan(app: FastAPI):
    # KVHOLD_RUNTIME_DIR (if set) is honoured by for_instance, as by every kvhold tool.
    app.state.kvhold = AsyncClient.for_instance(os.environ.get("KVHOLD_INSTANCE", "default"), timeout=30)
    yield
    await app.state.kvhold.close()


app = FastAPI(title="my app on kvhold", lifespan=lifespan)


@app.exception_handler(KvholdError)
async def kvhold_error(request: Request, exc: KvholdError):
    status = 400 if isinstance(exc, InvalidParams) else 503 if isinstance(exc, SidecarUnavailable) else 500
    return JSONResponse({"error": str(exc), "code": exc.code.name}, status)


def _options(body: dict) -> dict:
    allowed = ("max_tokens", "temperature", "top_p", "top_k", "seed")
    return {k: body[k] for k in allowed if k in body}


@app.post("/generate")
async def generate(request: Request):
    """The whole answer at once."""
    body = await request.json()
    stream = await app.state.kvhold.generate(body["prompt"], **_options(body))
    result = await stream.result()
    return {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason}


@app.post("/stream")
async def stream(request: Request):
    """One JSON line per token, as it is committed."""
    body = await request.json()
    s = await app.state.kvhold.generate(body["prompt"], **_options(body))

    async def lines():
        try:
            async for event in s:
                yield json.dumps({"index": event.index, "token_id": event.token_id, "text": event.text}) + "\n"
            result = await s.result()
            yield json.dumps({"finish_reason": result.finish_reason}) + "\n"
        finally:
            await s.cancel()  # a no-op once finished; frees the request if the client went away

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="example app using kvhold's async SDK")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
