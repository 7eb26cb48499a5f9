"""Sessions and the workers that host them.

Owns client sessions, training and sampling sessions and samplers (`sessions`), worker
heartbeats and session leases (`leases`), the Celery app, per-session queues and wake-ups
(`routing`), the supervision of `treadle up`'s worker processes (`supervisor`) and the
operator's view of the running platform (`status`).

May import the platform's top modules, `eventlog` and `tenancy`. Called by `billing`,
`checkpoints`, `operations`, `audit`, `serving`, the API and the workers.
"""
