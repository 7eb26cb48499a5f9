"""The OpenAI-compatible routes under `/v1` and `/oai/api/v1` (`routes`: models, completions,
chat completions). Their bodies, answers and streams are `treadle.api.chat`'s; the sampling itself is
`treadle.platform.serving`'s.

Imports the shared `treadle.api` modules and `treadle.platform`; never another surface.
"""
