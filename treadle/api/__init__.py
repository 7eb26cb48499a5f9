"""The HTTP edge: the Flask app and its three surfaces.

The modules here are what every surface shares: the app factory (`app`, and the production
entries `wsgi` and `gunicorn_conf`), authentication (`auth`), request bodies (`body`: bounded
JSON, then pydantic through `parse`), the request accessors (`context`), error translation
(`errors`), admission at the edge (`admission`), the API's metrics (`telemetry`,
`routes_metrics`) and its OpenAPI document (`openapi`, `routes_docs`). The surfaces:

- `tinker/`: the Tinker protocol (`/api/v1/...`, `/hf`), which the official SDK, CLI and
  tinker-cookbook speak;
- `treadle/`: Treadle's own routes under `/api/v1/treadle` (tenants and keys, billing,
  replay and fork, status, audit);
- `openai/`: the OpenAI-compatible routes under `/v1`.

Views parse, call the platform and serialise; they hold no business rules. A surface imports
the shared modules and `treadle.platform`, never another surface; of the shared modules only
`app` (which registers the blueprints) and `openapi` (which documents their bodies) import a
surface. Never imports torch, `treadle.engine` or `treadle.worker`.
"""
