"""The OpenAI-compatible routes under `/v1` (`routes`: models, completions, chat completions),
their bodies (`schemas`) and their answers, whole or as a server-sent event stream (`answers`).
The sampling itself is `treadle.platform.serving`'s.

Imports the shared `treadle.api` modules and `treadle.platform`; never another surface.
"""
