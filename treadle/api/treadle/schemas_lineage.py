"""Request bodies of the replay and fork routes (`routes_lineage`), as pydantic models; a
parsing failure is a 400 naming the field. Imports platform only; never torch.
"""

from __future__ import annotations

from pydantic import Field

from treadle.api.body import MAX_ID, Body, Id


class OpenReplay(Body):
    """Replay a session's log in a new sandbox of the caller's client session `session_id`."""

    session_id: Id  # the caller's client session (create_session)
    model_seq_id: int = Field(ge=0, le=MAX_ID)  # the new model's number in that client session
    to_seq: int | None = Field(None, ge=0, le=MAX_ID)  # default: all the source applied


class OpenFork(Body):
    """Fork a session as it stood right after `at_seq`, into the caller's client session."""

    session_id: Id
    model_seq_id: int = Field(ge=0, le=MAX_ID)
    at_seq: int = Field(ge=0, le=MAX_ID)
    training_session_name: Id | None = None
