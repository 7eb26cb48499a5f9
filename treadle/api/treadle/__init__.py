"""Treadle's own routes under `/api/v1/treadle`, which Treadle's SDK and the `treadle` command
call.

Tenants and keys (`routes_admin`), prices, quotas, usage and bills (`routes_billing`), replay
and fork (`routes_lineage`), the operator's status (`routes_status`), and base models,
tokenizers, session stop and audit (`routes_extensions`); their bodies (`schemas_*`).

Imports the shared `treadle.api` modules and `treadle.platform`; never another surface.
"""
