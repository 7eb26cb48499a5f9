"""Object storage for checkpoints, exported weights and blobs, behind one small interface.

`ObjectStore` is what the platform codes against; `LocalStore` keeps objects as files under a
directory, `S3Store` in an S3-compatible bucket (boto3, imported lazily). Keys are built by
`tenant_key` / `content_key`, never taken from input (ARCHITECTURE.md §6), and every store method
validates the key it is given. Imports nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import os
import secrets
import shutil
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from treadle.platform.config import PlatformConfig
from treadle.platform.errors import NotFoundError, UnavailableError, ValidationError

MAX_SEGMENT_CHARS = 128


@runtime_checkable
class ObjectStore(Protocol):
    """Flat keys (`a/b/c`) to bytes; a put replaces the whole object. `list(p)` and
    `delete_prefix(p)` see the keys below `p + "/"` (so `tenants/a` never matches `tenants/ab`).
    """

    def put_bytes(self, key: str, data: bytes) -> None: ...
    def get_bytes(self, key: str) -> bytes: ...
    def put_file(self, key: str, path: Path) -> None: ...
    def get_file(self, key: str, path: Path) -> None: ...
    def exists(self, key: str) -> bool: ...
    def size(self, key: str) -> int: ...
    def delete(self, key: str) -> None: ...
    def delete_prefix(self, prefix: str) -> int: ...
    def list(self, prefix: str) -> builtins.list[str]: ...


def _segment_problem(segment: str) -> str | None:
    if not segment:
        return "is empty (a doubled or trailing '/'); remove it"
    if len(segment) > MAX_SEGMENT_CHARS:
        return f"has {len(segment)} characters; the limit is {MAX_SEGMENT_CHARS}"
    if segment in (".", ".."):
        return f"is {segment!r}; relative segments are not allowed"
    if "\x00" in segment:
        return "contains a NUL character"
    if "\\" in segment:
        return "contains a backslash; separate segments with '/'"
    control = next((ch for ch in segment if unicodedata.category(ch) == "Cc"), None)
    if control is not None:
        return f"contains the control character {control!r}"
    return None


def _show(text: str) -> str:
    return repr(text) if len(text) <= 80 else repr(text[:77]) + "..."


def validate_key(key: str, what: str = "storage key") -> str:
    """Return `key` if it is a valid relative `/`-separated key; raise ValidationError if not."""
    if not key:
        raise ValidationError(f"{what} is empty; build keys with tenant_key(tenant_id, ...)")
    if key.startswith("/"):
        raise ValidationError(f"{what} {_show(key)} starts with '/'; keys are relative")
    for index, segment in enumerate(key.split("/")):
        problem = _segment_problem(segment)
        if problem is not None:
            raise ValidationError(f"{what} {_show(key)}: segment {index} {problem}")
    return key


def _validate_prefix(prefix: str, *, allow_empty: bool) -> str:
    """A prefix is a key, optionally with one trailing '/'; '' (everything) only if allowed."""
    if allow_empty and prefix in ("", "/"):
        return ""
    return validate_key(prefix.removesuffix("/"), "prefix")


def tenant_key(tenant_id: str, *parts: str) -> str:
    """`tenants/<tenant>/<part>/...`; each argument must be one valid segment (no '/')."""
    if nested := [part for part in (tenant_id, *parts) if "/" in part]:
        raise ValidationError(f"key part {_show(nested[0])} contains '/'; pass segments separately")
    return validate_key("/".join(("tenants", tenant_id, *parts)))


def content_key(tenant_id: str, data: bytes) -> str:
    """The content-addressed key of a blob: `tenants/<tenant>/blobs/<sha256 hex>`."""
    return tenant_key(tenant_id, "blobs", hashlib.sha256(data).hexdigest())


@contextlib.contextmanager
def _atomic_write(path: Path) -> Iterator[IO[bytes]]:
    """Write to a hidden temp file beside `path`, fsync, then rename it over `path`."""
    tmp = path.parent / (".partial-" + secrets.token_hex(64))  # longer than a segment: never a key
    for attempt in range(3):  # a concurrent delete may prune the empty directory in between
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            file = tmp.open("xb")
            break
        except FileNotFoundError:
            if attempt == 2:
                raise
    try:
        with file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class LocalStore:
    """Objects as files under `root` (key `a/b` is `root/a/b`); writes are atomic renames.

    A key cannot also be a prefix of other keys here (a file is not a directory): OSError.
    """

    def __init__(self, root: Path) -> None:
        Path(root).mkdir(parents=True, exist_ok=True)
        self.root = Path(root).resolve()

    def _path(self, key: str, what: str = "storage key") -> Path:
        path = self.root.joinpath(*validate_key(key, what).split("/"))
        if not path.resolve().is_relative_to(self.root):  # a symlink inside root pointing out
            raise ValidationError(
                f"{what} {_show(key)} resolves outside the store root {self.root}"
            )
        return path

    def _prune(self, directory: Path) -> None:
        """Remove empty directories from `directory` up to (not including) the root."""
        while directory != self.root and directory.is_relative_to(self.root):
            try:
                directory.rmdir()
            except OSError:
                return
            directory = directory.parent

    def put_bytes(self, key: str, data: bytes) -> None:
        with _atomic_write(self._path(key)) as file:
            file.write(data)

    def get_bytes(self, key: str) -> bytes:
        with self._open(key) as file:
            return file.read()

    def put_file(self, key: str, path: Path) -> None:
        with open(path, "rb") as source, _atomic_write(self._path(key)) as file:
            shutil.copyfileobj(source, file)

    def get_file(self, key: str, path: Path) -> None:
        with self._open(key) as source, _atomic_write(Path(path)) as file:
            shutil.copyfileobj(source, file)

    def _open(self, key: str) -> IO[bytes]:
        try:
            return self._path(key).open("rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFoundError(f"no object at {_show(key)}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        path = self._path(key)
        if not path.is_file():
            raise NotFoundError(f"no object at {_show(key)}")
        return path.stat().st_size

    def delete(self, key: str) -> None:
        path = self._path(key)
        with contextlib.suppress(FileNotFoundError, IsADirectoryError, NotADirectoryError):
            path.unlink()
            self._prune(path.parent)

    def delete_prefix(self, prefix: str) -> int:
        base = self._path(_validate_prefix(prefix, allow_empty=False), "prefix")
        keys = self.list(prefix)
        for key in keys:
            self._path(key).unlink(missing_ok=True)
        for directory, _, _ in os.walk(base, topdown=False):
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        self._prune(base.parent)
        return len(keys)

    def list(self, prefix: str) -> builtins.list[str]:
        prefix = _validate_prefix(prefix, allow_empty=True)
        base = self._path(prefix, "prefix") if prefix else self.root
        keys: builtins.list[str] = []
        for directory, _, names in os.walk(base):
            parts = Path(directory).relative_to(self.root).parts
            keys.extend("/".join((*parts, n)) for n in names if _segment_problem(n) is None)
        return sorted(keys)


class S3Store:
    """Objects in one bucket of an S3-compatible server, created if missing.

    `page_size` is the listing page (S3 caps it at 1000); files at or above `multipart_bytes`
    go up in parts of that size.
    """

    def __init__(
        self,
        endpoint_url: str,
        bucket: str,
        access_key: str = "",
        secret_key: str = "",
        region: str = "us-east-1",
        *,
        page_size: int = 1000,
        multipart_bytes: int = 8 << 20,
    ) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        if not 1 <= page_size <= 1000:
            raise ValidationError(f"page_size is {page_size}; S3 allows 1 to 1000")
        self.endpoint_url, self.bucket, self.region = endpoint_url, bucket, region or "us-east-1"
        self.page_size = page_size
        self._transfer = TransferConfig(
            multipart_threshold=multipart_bytes, multipart_chunksize=multipart_bytes
        )
        self._client: Any = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            aws_access_key_id=access_key or None,  # None: boto3's own credential chain
            aws_secret_access_key=secret_key or None,
            region_name=self.region,
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},  # self-hosted servers have no bucket DNS names
                retries={"max_attempts": 5, "mode": "standard"},
            ),
        )
        self._ensure_bucket()

    @contextlib.contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        """boto3's errors as Treadle's: a missing object is NotFound, the rest Unavailable."""
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except (ClientError, BotoCoreError, Boto3Error) as exc:
            code = str((getattr(exc, "response", None) or {}).get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchKey", "NotFound"):
                raise NotFoundError(f"no object at {_show(key)}") from None
            raise UnavailableError(
                f"object store {self.endpoint_url} (bucket {self.bucket!r}) failed on "
                f"{_show(key)}: {exc}; check the endpoint, the credentials and the bucket"
            ) from exc

    def _has_bucket(self) -> bool:
        try:
            with self._errors(self.bucket):
                self._client.head_bucket(Bucket=self.bucket)
        except NotFoundError:
            return False
        return True

    def _ensure_bucket(self) -> None:
        """Create the bucket if missing; losing a creation race to another process is fine."""
        if self._has_bucket():
            return
        extra: dict[str, Any] = {}
        if self.region != "us-east-1":  # us-east-1 rejects its own name as a constraint
            extra["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        try:
            with self._errors(self.bucket):
                self._client.create_bucket(Bucket=self.bucket, **extra)
        except UnavailableError:
            if not self._has_bucket():  # else BucketAlreadyOwnedByYou: another process won
                raise

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._errors(validate_key(key)):
            self._client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def get_bytes(self, key: str) -> bytes:
        with self._errors(validate_key(key)):
            data: bytes = self._client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        return data

    def put_file(self, key: str, path: Path) -> None:
        with self._errors(validate_key(key)):
            self._client.upload_file(str(path), self.bucket, key, Config=self._transfer)

    def get_file(self, key: str, path: Path) -> None:
        with self._errors(validate_key(key)), _atomic_write(Path(path)) as file:
            self._client.download_fileobj(self.bucket, key, file, Config=self._transfer)

    def exists(self, key: str) -> bool:
        with contextlib.suppress(NotFoundError):
            return self.size(key) >= 0
        return False

    def size(self, key: str) -> int:
        with self._errors(validate_key(key)):
            return int(self._client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])

    def delete(self, key: str) -> None:
        with self._errors(validate_key(key)):
            self._client.delete_object(Bucket=self.bucket, Key=key)

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(_validate_prefix(prefix, allow_empty=False))
        for start in range(0, len(keys), 1000):
            batch = [{"Key": key} for key in keys[start : start + 1000]]
            with self._errors(prefix):
                response = self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )
            if errors := response.get("Errors"):
                first = f"{errors[0].get('Key')!r}: {errors[0].get('Code')}"
                raise UnavailableError(f"could not delete {len(errors)} objects, e.g. {first}")
        return len(keys)

    def list(self, prefix: str) -> builtins.list[str]:
        prefix = _validate_prefix(prefix, allow_empty=True)
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket,
            Prefix=prefix + "/" if prefix else "",
            PaginationConfig={"PageSize": self.page_size},
        )
        keys: builtins.list[str] = []
        with self._errors(prefix):
            for page in pages:
                keys.extend(item["Key"] for item in page.get("Contents", ()))
        return sorted(keys)


def store_from_config(config: PlatformConfig) -> ObjectStore:
    """`S3Store` when an S3 endpoint is configured, else a `LocalStore` under the data dir."""
    if config.s3_endpoint:
        return S3Store(
            config.s3_endpoint,
            config.s3_bucket,
            config.s3_access_key,
            config.s3_secret_key,
            config.s3_region,
        )
    return LocalStore(config.storage_dir)
