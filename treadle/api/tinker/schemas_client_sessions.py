"""Request bodies and query strings of the Tinker session routes (`routes_tinker_sessions`), as
pydantic models parsed with `body.parse`: a failure is a 400 naming the field.

`SearchSessions` mirrors tinker.types.SessionSearchRequest (its owner and status queries are
discriminated by `type`) with every string, list and map bounded; unknown fields are ignored.
Imports platform only; never torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from treadle.api.body import MAX_ID, Body, Id, Time
from treadle.platform.models.validation import MAX_ID_LENGTH, MAX_METADATA_KEYS

MAX_LIST_LIMIT = 1000
MAX_SEARCH_LIMIT = 200
MAX_OWNERS = 10
MAX_PROJECTS = 16

AccessScope = Literal["owned", "accessible"]
Text = Annotated[str, Field(max_length=MAX_ID_LENGTH)]


class ListSessionsQuery(Body):
    """GET /api/v1/sessions: a page of the caller's client session ids, newest first."""

    limit: int = Field(20, ge=1, le=MAX_LIST_LIMIT)
    offset: int = Field(0, ge=0, le=MAX_ID)
    access_scope: AccessScope = "owned"


class SessionQuery(Body):
    access_scope: AccessScope = "owned"


class AuditQuery(Body):
    """GET /api/v1/audit: a category and a UTC day (today when omitted)."""

    # audit_log.CATEGORIES
    event_type: Literal["all", "checkpoints", "projects", "teams", "organizations"] = "all"
    day: Time | None = None  # YYYY-MM-DD; its UTC midnight


class OwnOwner(Body):
    type: Literal["own"]


class AccessibleOwner(Body):
    type: Literal["accessible"]


class UserOwner(Body):
    type: Literal["user"]
    owner_urns: list[Text] = Field(min_length=1, max_length=MAX_OWNERS)


Owner = Annotated[OwnOwner | AccessibleOwner | UserOwner, Field(discriminator="type")]


class ActiveStatus(Body):
    type: Literal["active"]


class CancelledStatus(Body):
    type: Literal["cancelled"]


class FailedStatus(Body):
    type: Literal["failed"]


class ClientFinishedStatus(Body):
    type: Literal["client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = Field(
        None, min_length=1, max_length=3
    )


StatusQuery = Annotated[
    ActiveStatus | CancelledStatus | FailedStatus | ClientFinishedStatus,
    Field(discriminator="type"),
]


class SearchCursor(Body):
    last_created_at: Time
    last_session_id: Id


class SearchSessions(Body):
    """POST /api/v1/sessions/search (tinker.types.SessionSearchRequest)."""

    session_id: Id | None = None
    project_ids: list[Text] | None = Field(None, max_length=MAX_PROJECTS)
    user_metadata: dict[Text, Text] = Field(default_factory=dict, max_length=MAX_METADATA_KEYS)
    display_name: Text | None = Field(None, min_length=1)
    owner: Owner = Field(default_factory=lambda: OwnOwner(type="own"))
    statuses: list[StatusQuery] | None = Field(None, min_length=1, max_length=8)
    limit: int = Field(50, ge=1, le=MAX_SEARCH_LIMIT)
    cursor: SearchCursor | None = None
