"""SigV4 verification of SageMaker requests: who signed a request (principal, region, service),
or a `SigV4Error` carrying the AWS error code the SageMaker surface answers with.

`verify` is pure: the request's parts (method, the raw path and query string as the client sent
them, headers, body bytes), a lookup from access key id to (principal, secret), the time and the
accepted regions. The canonical request is built exactly as botocore builds it for the
`sagemaker` services (botocore.auth.SigV4Auth): the path with botocore's dot-segment and
double-slash removal, URI-encoded once more (safe `/~`); the query's pairs sorted as sent;
signed headers lowercased, trimmed, runs of spaces collapsed; the payload hash the SHA-256 of
the raw body. `authenticate` is the Flask-facing helper the blueprint calls. Imports platform
and the shared api modules only; never torch.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import quote, urlsplit

from flask import Request, request

from treadle.api import auth
from treadle.api.context import services
from treadle.platform.config import AWS_REGION_NAME
from treadle.platform.errors import AuthenticationError, PermissionDeniedError
from treadle.platform.tenancy.access_keys import SecretsKeyError
from treadle.platform.tenancy.tenants import Principal

ALGORITHM = "AWS4-HMAC-SHA256"
SERVICE = "sagemaker"
TERMINATOR = "aws4_request"
MAX_SKEW = timedelta(minutes=5)  # AWS's allowance between X-Amz-Date and the server's clock
AMZ_DATE_FORMAT = "%Y%m%dT%H%M%SZ"
_AMZ_DATE = re.compile(r"^\d{8}T\d{6}Z$")

MISSING_TOKEN = "MissingAuthenticationTokenException"
INCOMPLETE = "IncompleteSignatureException"
UNRECOGNIZED = "UnrecognizedClientException"
INVALID = "InvalidSignatureException"
ACCESS_DENIED = "AccessDeniedException"
MISMATCH = (
    "The request signature we calculated does not match the signature you provided. Check your "
    "AWS Secret Access Key and signing method. Consult the service documentation for details."
)

# access key id -> (principal, secret); Authenticator.signing_key returns a SigningKey, a tuple.
SigningKeyLookup = Callable[[str], tuple[Principal, str]]
Headers = Mapping[str, str] | Iterable[tuple[str, str]]


class SigV4Error(AuthenticationError):
    """A request whose signature is missing, malformed or wrong; `aws_code` is the AWS error
    code (MissingAuthenticationTokenException, IncompleteSignatureException,
    UnrecognizedClientException, InvalidSignatureException, AccessDeniedException)."""

    def __init__(self, aws_code: str, message: str) -> None:
        super().__init__(message)
        self.aws_code = aws_code

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # type: ignore[override]
        return (type(self), (self.aws_code, self.message))


class SigV4AccessDeniedError(SigV4Error, PermissionDeniedError):
    """A correctly signed request whose key may not be used (its tenant is disabled): 403."""

    status = 403
    code = "permission_denied"


@dataclass(frozen=True)
class SignedBy:
    """Who signed a verified request, and the region its scope named (ARNs echo it)."""

    principal: Principal
    access_key_id: str
    region: str
    service: str


def verify(
    *,
    method: str,
    path: str,
    query: str,
    headers: Headers,
    body: bytes,
    lookup: SigningKeyLookup,
    now: datetime,
    regions: Collection[str] = (),
) -> SignedBy:
    """Check a request's SigV4 signature (Authorization header form).

    Args:
        path: the path as the client sent it, still percent-encoded, without the query.
        query: the raw query string (without '?').
        regions: the regions a scope may name; empty: any well-formed region name.
    Raises:
        SigV4Error: its `aws_code` says why (SigV4AccessDeniedError for a disabled tenant).
    """
    fields = _header_lists(headers)
    authorization = _one(fields, "authorization")
    if not authorization:
        raise SigV4Error(
            MISSING_TOKEN,
            "Missing Authentication Token: sign the request with SigV4 (service 'sagemaker'), "
            "e.g. boto3 or the sagemaker SDK with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "set to a pair from `treadle keys create --aws`",
        )
    credential, signed_names, signature = _parse_authorization(authorization)
    amz_date = _one(fields, "x-amz-date")
    if amz_date is None:
        raise SigV4Error(
            INCOMPLETE, "Authorization header requires existence of a 'X-Amz-Date' header."
        )
    signed_at = _parse_amz_date(amz_date)
    _check_signed_headers(fields, signed_names)
    if "x-amz-security-token" in fields:
        raise SigV4Error(
            UNRECOGNIZED,
            "The security token included in the request is invalid: Treadle issues no session "
            "tokens. Unset AWS_SESSION_TOKEN (and any profile's aws_session_token) and sign with "
            "the long-term pair from `treadle keys create --aws`",
        )
    access_key_id, scope_date, region, service, terminator = credential
    _check_scope(amz_date, scope_date, region, service, terminator, regions)
    _check_clock(amz_date, signed_at, now)
    principal, secret = _look_up(lookup, access_key_id)

    payload_hash = hashlib.sha256(body).hexdigest()
    declared = _one(fields, "x-amz-content-sha256")
    if declared is not None and declared.strip().lower() != payload_hash:
        raise SigV4Error(
            INVALID,
            "The provided 'x-amz-content-sha256' header does not match what was computed: it "
            "must be the SHA-256 of the body (UNSIGNED-PAYLOAD is not accepted)",
        )
    missing = [name for name in signed_names if name not in fields]
    if missing:
        raise SigV4Error(
            INVALID, f"{MISMATCH} (signed header {missing[0]!r} is not in the request)"
        )
    canonical = canonical_request(method, path, query, fields, signed_names, payload_hash)
    scope = f"{scope_date}/{region}/{service}/{TERMINATOR}"
    string_to_sign = "\n".join(
        [ALGORITHM, amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    expected = signature_of(secret, scope_date, region, service, string_to_sign)
    if not hmac.compare_digest(expected.encode(), signature.encode()):
        raise SigV4Error(INVALID, MISMATCH)
    return SignedBy(principal, access_key_id, region, service)


def canonical_request(
    method: str,
    path: str,
    query: str,
    fields: Mapping[str, list[str]],
    signed_names: list[str],
    payload_hash: str,
) -> str:
    """botocore's canonical request (`SigV4Auth.canonical_request`) from the received parts;
    `fields` maps lowercase header names to their values."""
    header_lines = "".join(
        f"{name}:{','.join(' '.join(v.split()) for v in fields.get(name, []))}\n"
        for name in signed_names
    )
    return "\n".join(
        [
            method.upper(),
            quote(_remove_dot_segments(path) or "/", safe="/~"),
            _canonical_query(query),
            header_lines,
            ";".join(signed_names),
            payload_hash,
        ]
    )


def signature_of(secret: str, date: str, region: str, service: str, string_to_sign: str) -> str:
    """HMAC-SHA256 of `string_to_sign` under the key SigV4 derives from the secret and scope."""
    key = ("AWS4" + secret).encode()
    for part in (date, region, service, TERMINATOR):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()


def verify_flask_request(
    req: Request, lookup: SigningKeyLookup, regions: Collection[str], now: datetime | None = None
) -> SignedBy:
    """`verify` over a Flask request: the path as the client sent it (RAW_URI / REQUEST_URI,
    which gunicorn, waitress and werkzeug set; else request.path quoted again), the raw query
    string, the headers and the body (read within the request's max_content_length)."""
    return verify(
        method=req.method,
        path=raw_path(req),
        query=_wsgi_text(req.query_string),
        headers=[(name, _header_text(value)) for name, value in req.headers],
        # An unsigned request is refused before its body is read.
        body=req.get_data(cache=True) if "Authorization" in req.headers else b"",
        lookup=lookup,
        now=now or datetime.now(UTC),
        regions=regions,
    )


def authenticate() -> SignedBy:
    """The one call the SageMaker blueprint makes: `flask.request` checked against the app's
    access keys (auth.Authenticator.signing_key, cached like X-API-Key checks) and the
    configured regions (TREADLE_AWS_REGIONS), its body limited to
    TREADLE_SAGEMAKER_MAX_BODY_BYTES (a larger one is werkzeug's 413)."""
    config = services().config
    request.max_content_length = config.sagemaker_max_body_bytes
    return verify_flask_request(request, auth.signing_key, config.aws_regions)


def raw_path(req: Request) -> str:
    raw = req.environ.get("RAW_URI") or req.environ.get("REQUEST_URI")
    if not raw:
        return quote(req.script_root + req.path, safe="/")
    target = raw.split("#", 1)[0]
    if "://" in target.split("?", 1)[0]:  # absolute form: http://host/path?query
        target = urlsplit(target).path
    return _wsgi_text(target.split("?", 1)[0].encode("latin-1"))


def _wsgi_text(raw: bytes) -> str:
    """WSGI's bytes (carried as latin-1 text) as the UTF-8 text the client signed."""
    return raw.decode("utf-8", "replace")


def _header_text(value: str) -> str:
    try:
        return _wsgi_text(value.encode("latin-1"))
    except UnicodeEncodeError:  # not WSGI's latin-1 form: text already
        return value


def _header_lists(headers: Headers) -> dict[str, list[str]]:
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    fields: dict[str, list[str]] = {}
    for name, value in pairs:
        fields.setdefault(name.lower(), []).append(value)
    return fields


def _one(fields: Mapping[str, list[str]], name: str) -> str | None:
    values = fields.get(name)
    return ",".join(values) if values else None


def _parse_authorization(header: str) -> tuple[list[str], list[str], str]:
    """(the Credential's five parts, the signed header names sorted, the Signature)."""
    algorithm, _, rest = header.strip().partition(" ")
    if algorithm != ALGORITHM:
        raise SigV4Error(
            INCOMPLETE,
            f"Authorization header is malformed: its algorithm must be {ALGORITHM} (SigV4 "
            f"with signing name 'sagemaker'), got {algorithm[:32]!r}",
        )
    parts: dict[str, str] = {}
    for item in rest.split(","):
        name, eq, value = item.strip().partition("=")
        if not eq:
            raise SigV4Error(
                INCOMPLETE,
                "Authorization header is malformed: expected Credential=..., "
                "SignedHeaders=..., Signature=... separated by commas",
            )
        parts[name] = value.strip()
    missing = [p for p in ("Credential", "Signature", "SignedHeaders") if not parts.get(p)]
    if missing:
        raise SigV4Error(
            INCOMPLETE,
            " ".join(f"Authorization header requires '{p}' parameter." for p in missing),
        )
    credential = parts["Credential"].split("/")
    if len(credential) != 5 or not all(credential):
        raise SigV4Error(
            INCOMPLETE,
            "Authorization header is malformed: the Credential must be "
            '"<access key id>/<YYYYMMDD>/<region>/sagemaker/aws4_request"',
        )
    names = sorted({name.strip().lower() for name in parts["SignedHeaders"].split(";")})
    return credential, [name for name in names if name], parts["Signature"]


def _parse_amz_date(amz_date: str) -> datetime:
    try:
        if not _AMZ_DATE.match(amz_date):
            raise ValueError(amz_date)
        return datetime.strptime(amz_date, AMZ_DATE_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        raise SigV4Error(
            INCOMPLETE,
            f"Date must be in ISO-8601 'basic format' (YYYYMMDDTHHMMSSZ). Got {amz_date[:32]!r}.",
        ) from None


def _check_signed_headers(fields: Mapping[str, list[str]], signed: list[str]) -> None:
    if "host" not in signed:
        raise SigV4Error(INCOMPLETE, "'Host' must be a 'SignedHeader' in the AWS Authorization.")
    if "x-amz-date" not in signed:
        raise SigV4Error(
            INCOMPLETE, "'X-Amz-Date' must be a 'SignedHeader' in the AWS Authorization."
        )
    if "x-amz-target" in fields and "x-amz-target" not in signed:
        raise SigV4Error(
            INCOMPLETE,
            "'X-Amz-Target' is in the request, so it must be a 'SignedHeader' in the AWS "
            "Authorization: sign it (boto3 does)",
        )


def _check_scope(
    amz_date: str,
    scope_date: str,
    region: str,
    service: str,
    terminator: str,
    regions: Collection[str],
) -> None:
    if terminator != TERMINATOR:
        raise SigV4Error(
            INVALID,
            f"Credential should be scoped with a valid terminator: '{TERMINATOR}', not "
            f"{terminator[:32]!r}.",
        )
    if service != SERVICE:
        raise SigV4Error(
            INVALID,
            f"Credential should be scoped to correct service: '{SERVICE}', not {service[:32]!r}.",
        )
    if scope_date != amz_date[:8]:
        raise SigV4Error(
            INVALID,
            "Date in Credential scope does not match YYYYMMDD from ISO-8601 version of date "
            f"from HTTP: {scope_date[:16]!r} != '{amz_date[:8]}', from '{amz_date}'.",
        )
    if regions and region not in regions:
        raise SigV4Error(
            INVALID,
            f"Credential should be scoped to a valid region, not {region[:32]!r}: this server "
            f"accepts {', '.join(sorted(regions))} (TREADLE_AWS_REGIONS); set AWS_REGION to one",
        )
    if not AWS_REGION_NAME.match(region):
        raise SigV4Error(
            INVALID,
            f"Credential should be scoped to a valid region, not {region[:32]!r}: a region name "
            "is lowercase letters, digits and hyphens, like us-east-1",
        )


def _check_clock(amz_date: str, signed_at: datetime, now: datetime) -> None:
    now = now if now.tzinfo is not None else now.replace(tzinfo=UTC)
    now = now.astimezone(UTC)
    stamp = now.strftime(AMZ_DATE_FORMAT)
    if signed_at < now - MAX_SKEW:
        raise SigV4Error(
            INVALID,
            f"Signature expired: {amz_date} is now earlier than "
            f"{(now - MAX_SKEW).strftime(AMZ_DATE_FORMAT)} ({stamp} - 5 min.)",
        )
    if signed_at > now + MAX_SKEW:
        raise SigV4Error(
            INVALID,
            f"Signature not yet current: {amz_date} is still later than "
            f"{(now + MAX_SKEW).strftime(AMZ_DATE_FORMAT)} ({stamp} + 5 min.)",
        )


def _look_up(lookup: SigningKeyLookup, access_key_id: str) -> tuple[Principal, str]:
    try:
        return lookup(access_key_id)
    except PermissionDeniedError as exc:
        raise SigV4AccessDeniedError(ACCESS_DENIED, exc.message) from None
    except (AuthenticationError, SecretsKeyError) as exc:
        # SecretsKeyError: the server's TREADLE_SECRETS_KEY is unset or lacks the key; its
        # message tells the operator what to do, and no retry would help.
        raise SigV4Error(UNRECOGNIZED, exc.message) from None


def _canonical_query(query: str) -> str:
    """botocore's `_canonical_query_string_url`: the pairs as sent, sorted by key then value."""
    if not query:
        return ""
    pairs = sorted(pair.partition("=")[::2] for pair in query.split("&"))
    return "&".join(f"{key}={value}" for key, value in pairs)


def _remove_dot_segments(path: str) -> str:
    """botocore.utils.remove_dot_segments: RFC 3986 5.2.4, and runs of '/' collapsed."""
    if not path:
        return ""
    kept: list[str] = []
    for segment in path.split("/"):
        if segment == "..":
            if kept:
                kept.pop()
        elif segment and segment != ".":
            kept.append(segment)
    first = "/" if path[0] == "/" else ""
    last = "/" if path[-1] == "/" and kept else ""
    return first + "/".join(kept) + last
