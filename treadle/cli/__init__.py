"""The `treadle` command, one module per verb group.

`main` builds the parser and dispatches; `serve` runs the platform (`up`, `worker`,
`migrate`); the HTTP clients' verbs are `checkpoints`, `admin` (`tenants`, `keys`), `billing`
(`prices`, `quotas`, `usage`, `bill`), `audit` (`sessions`, `audit`), `lineage` (`replay`,
`fork`) and `status`, all through Treadle's SDK (TREADLE_BASE_URL, TREADLE_API_KEY); `errors`
is their shared report of a failed HTTP call. `python -m treadle.cli` runs it too.
"""
