"""The event log and its vocabulary: what is written, and how a write is announced.

Owns the schema of every table (`schema`, kept equal to the Alembic migrations), the
append-only event store (`events`), the operation vocabulary and typed payloads (`optypes`),
the per-operation log line (`oplog`), completion notices over Redis (`notify`) and a streamed
sample's progress and cancel marks (`progress`).

The lowest domain package: it imports the platform's top modules (errors, config, metrics)
and no other package. Everything else reads and writes through it.
"""
