"""An operation's life: admitted, executed by a worker, settled; and the commands that start it.

Owns admission and settlement (`operations`: `OperationRequested` and the `operations` row in
one transaction, a resent seq_id deduplicated; the outcome written under the lease epoch), the
platform commands the API's views call (`commands`), failing operations before they run
(`cancellation`), futures beyond one result (`futures`) and the provenance checks of recorded
samples (`recorded_samples`).

May import the platform's top modules, `eventlog`, `tenancy`, `sessions` and `billing`.
Called by `audit` (replay and fork), `serving`, the API and the workers.
"""
