"""Money and limits: prices, quotas, metering and the ledger's read side.

Owns versioned prices per base model and token class (`prices`, with the built-in defaults in
`default_prices.toml`), each tenant's quotas (`quotas`), the reservation at admission and the
charge at settlement (`metering`), usage and bills read from the ledger (`usage`), the Tinker
protocol's hourly buckets (`usage_hourly`) and the state of billing now (`billing_status`).

May import the platform's top modules, `eventlog`, `tenancy` and `sessions`. Called by
`operations` (admission and settlement), `audit`, the API and the workers.
"""
