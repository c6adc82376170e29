"""The mesh page: static HTML, JS and CSS served by the controller (no build step, no CDN;
its one library, uPlot, is vendored under static/vendor/uplot/ with its license).

The page polls the REST API (`/v1/jobs`, `/v1/jobs/{id}`, `/v1/jobs/{id}/history`,
`/v1/jobs/{id}/events`) and draws the job list, the mesh coloured by rank state, the job's
whole loss and throughput history marked with its recoveries and checkpoints, and the event
timeline (docs/architecture.md, "Observability").
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"


def mount(app: FastAPI) -> None:
    app.mount("/ui", StaticFiles(directory=STATIC, html=True), name="ui")

    @app.get("/", include_in_schema=False)
    def home() -> RedirectResponse:
        return RedirectResponse("/ui/")
