"""The baseline: a bare FastAPI app that echoes the request body, nothing of the project in it.

Served by plain uvicorn (`uvicorn app.bench.echo_app:app --workers N`), so its figures are what
the framework and the machine give, with no middleware, auth or scheduling.
"""

from fastapi import FastAPI, Request, Response

app = FastAPI()


@app.post("/echo")
async def echo(request: Request) -> Response:
    return Response(await request.body(), media_type="application/octet-stream")
