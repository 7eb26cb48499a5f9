"""Request bodies of the tenant and key routes (`routes_admin`), as pydantic models parsed with
`body.parse` (unknown fields are ignored; a failure is a 400 naming the field).
Imports platform only; never torch.
"""

from __future__ import annotations

from pydantic import Field

from treadle.api.body import Body
from treadle.platform.tenancy.tenants import MAX_NAME


class CreateTenant(Body):
    """A new tenant; its first key is always an admin key."""

    id: str = Field(min_length=1, max_length=63)
    name: str | None = Field(None, min_length=1, max_length=MAX_NAME)


class CreateKey(Body):
    """A new key of `tenant_id` (the caller's tenant when omitted); `aws`: also an AWS-style
    access key pair for SigV4 (SageMaker's API), whose secret is shown once."""

    tenant_id: str | None = Field(None, min_length=1, max_length=63)
    # Checked by `keys.create_key`, whose message says how an operator key is made instead.
    role: str = Field("member", max_length=16, json_schema_extra={"enum": ["admin", "member"]})
    name: str | None = Field(None, min_length=1, max_length=MAX_NAME)
    aws: bool = Field(False, strict=True)
