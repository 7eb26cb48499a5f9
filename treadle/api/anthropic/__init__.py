"""The Anthropic Messages surface under `/anthropic/api/v1` (the path Tinker documents: an
Anthropic client's base URL is `<server>/anthropic/api`): `routes` (messages, count_tokens),
their request bodies (`schemas`) and the message and its server-sent events (`answers`). The
sampling is `treadle.platform.serving`'s and the admission `treadle.api.chat`'s, shared with the
OpenAI-compatible routes.

Imports the shared `treadle.api` modules and `treadle.platform`; never another surface.
"""
