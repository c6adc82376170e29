"""Swagger UI at /docs, served from the installed `swagger-ui-bundle` package (docs/security.md,
"HTTP input"): FastAPI's default page loads its script from a CDN, with no integrity check,
into a page on the API's own origin, so whoever controls the CDN could act with the token a
user types into it. Here every asset comes from the controller, and the page's CSP refuses
anything else. ReDoc (also CDN-only) is off."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

STATIC = "/docs/static"
# the page's own inline start-up script and style are the only inline code it runs
DOCS_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)


def install_docs(app: FastAPI) -> None:
    """Mount the assets and the page; the app is made with docs_url=None, redoc_url=None."""
    app.mount(STATIC, StaticFiles(directory=str(swagger_ui_path)), name="docs-static")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        page = get_swagger_ui_html(
            openapi_url=app.openapi_url,
            title=f"{app.title}: API",
            swagger_js_url=f"{STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{STATIC}/favicon-32x32.png",
        )
        page.headers["Content-Security-Policy"] = DOCS_CSP
        return page
