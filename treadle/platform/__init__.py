"""The platform's core: everything that is neither HTTP (`treadle.api`) nor compute and its
process (`treadle.engine`, `treadle.worker`).

One package per subject, layered so that each imports only those below it:
`eventlog` and `models` at the bottom; then `tenancy`; `sessions`; `billing` and
`checkpoints`; `operations`; `audit` and `serving` at the top. The modules here are the
process's plumbing, which every package may import and which import no package: `config`,
`db`, `embedded`, `logs`, `errors`, `metrics`, `after_commit`. Never imports api, engine, worker,
flask or torch (tests/unit/test_architecture.py checks the rules).
"""
