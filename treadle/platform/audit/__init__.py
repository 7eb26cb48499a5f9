"""Reading a session's history back, and rebuilding sessions from it.

Owns the audit reads of a session's events and timeline (`audit`), a tenant's audit log
(`audit_log`), the session listing with its usage (`session_listing`), the views of client
sessions (`client_session_views`), trace files and their download tokens (`traces`,
`trace_exports`), and replays and forks, new sessions built from another's log (`lineage`).

May import every package below it: the platform's top modules, `eventlog`, `tenancy`,
`sessions`, `billing` and `operations`. Called by the API only.
"""
