"""The object-store contract, run against every backend: LocalStore on a temp dir and S3Store on a
real SeaweedFS server (tests/integration/s3_server.py), plus the key builders."""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.s3_server import SeaweedS3
from treadle.platform.checkpoints.storage import (
    LocalStore,
    ObjectStore,
    S3Store,
    content_key,
    store_from_config,
    tenant_key,
)
from treadle.platform.config import PlatformConfig
from treadle.platform.errors import NotFoundError, UnavailableError, ValidationError

pytestmark = pytest.mark.integration

MB = 1 << 20
BAD_KEYS = {
    "dotdot": "tenants/acme/../other/x",
    "leading-dotdot": "../x",
    "dot": "tenants/./x",
    "nul": "tenants/acme/a\x00b",
    "empty-segment": "tenants//x",
    "trailing-slash": "tenants/acme/",
    "empty": "",
    "leading-slash": "/tenants/acme/x",
    "long-segment": "tenants/" + "a" * 129,
    "backslash": "tenants/acme/a\\b",
    "control": "tenants/acme/a\nb",
}


@pytest.fixture(scope="module")
def s3_server() -> Iterator[SeaweedS3]:
    server = SeaweedS3()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _s3_store(
    server: SeaweedS3, bucket: str = "", *, page_size: int = 1000, multipart_bytes: int = 8 * MB
) -> S3Store:
    return S3Store(
        server.endpoint_url,
        bucket or "test-" + secrets.token_hex(6),
        server.access_key,
        server.secret_key,
        page_size=page_size,
        multipart_bytes=multipart_bytes,
    )


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    return _s3_store(request.getfixturevalue("s3_server"))  # a fresh bucket per test


def _write_random(path: Path, size: int) -> str:
    data = os.urandom(size)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- the contract: every backend -------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 11, 5 * MB + 3], ids=["empty", "small", "5mb"])
def test_bytes_round_trip(store: ObjectStore, size: int) -> None:
    key = tenant_key("acme", "sessions", "s1", "weights.bin")
    data = os.urandom(size)
    store.put_bytes(key, data)
    assert store.get_bytes(key) == data
    assert store.size(key) == size


def test_put_replaces_the_previous_object(store: ObjectStore) -> None:
    key = tenant_key("acme", "state.json")
    store.put_bytes(key, b"first, and longer")
    store.put_bytes(key, b"second")
    assert store.get_bytes(key) == b"second"


def test_file_round_trip_of_20_mb(store: ObjectStore, tmp_path: Path) -> None:
    source, target = tmp_path / "source.bin", tmp_path / "out" / "target.bin"
    digest = _write_random(source, 20 * MB + 5)
    key = tenant_key("acme", "checkpoints", "step-1", "adapter.safetensors")
    store.put_file(key, source)
    assert store.size(key) == 20 * MB + 5
    store.get_file(key, target)
    assert _sha256(target) == digest
    assert os.listdir(target.parent) == ["target.bin"]  # no partial files left behind


def test_get_file_replaces_an_existing_file(store: ObjectStore, tmp_path: Path) -> None:
    key = tenant_key("acme", "blob")
    store.put_bytes(key, b"new")
    target = tmp_path / "target"
    target.write_bytes(b"old contents")
    store.get_file(key, target)
    assert target.read_bytes() == b"new"


def test_get_file_of_missing_key_leaves_the_destination_alone(
    store: ObjectStore, tmp_path: Path
) -> None:
    target = tmp_path / "out" / "target"
    target.parent.mkdir()
    target.write_bytes(b"keep me")
    with pytest.raises(NotFoundError):
        store.get_file(tenant_key("acme", "missing"), target)
    assert target.read_bytes() == b"keep me"
    assert os.listdir(target.parent) == ["target"]  # no partial file left behind


def test_exists_and_size(store: ObjectStore) -> None:
    key = tenant_key("acme", "a", "b")
    assert not store.exists(key)
    store.put_bytes(key, b"12345")
    assert store.exists(key)
    assert store.size(key) == 5
    assert not store.exists(tenant_key("acme", "a"))  # a prefix is not an object


@pytest.mark.parametrize("method", ["get_bytes", "size"])
def test_missing_key_raises_not_found(store: ObjectStore, method: str) -> None:
    with pytest.raises(NotFoundError, match="no object at"):
        getattr(store, method)(tenant_key("acme", "missing"))


def test_delete_is_idempotent(store: ObjectStore) -> None:
    key = tenant_key("acme", "x")
    store.put_bytes(key, b"x")
    store.delete(key)
    store.delete(key)
    store.delete(tenant_key("acme", "never-existed"))
    assert not store.exists(key)
    assert store.list(tenant_key("acme")) == []


def test_list_returns_sorted_keys_under_the_prefix_only(store: ObjectStore) -> None:
    for key in ["a/b/2", "a/b/1", "a/b/deep/3", "a/bc/4", "z/5"]:
        store.put_bytes(key, b".")
    expected = ["a/b/1", "a/b/2", "a/b/deep/3"]
    assert store.list("a/b") == expected
    assert store.list("a/b/") == expected
    assert store.list("a/b/1") == []  # an object is not a prefix
    assert store.list("a/nothing") == []
    assert store.list("") == ["a/b/1", "a/b/2", "a/b/deep/3", "a/bc/4", "z/5"]


def test_list_goes_past_1000_keys(store: ObjectStore) -> None:
    keys = [tenant_key("acme", "many", f"{i:05d}") for i in range(1100)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda key: store.put_bytes(key, b""), keys))
    assert store.list(tenant_key("acme", "many")) == keys
    assert store.delete_prefix(tenant_key("acme", "many")) == 1100
    assert store.list(tenant_key("acme")) == []


def test_delete_prefix_deletes_only_under_the_prefix(store: ObjectStore) -> None:
    doomed = [tenant_key("acme", "sessions", "s1", name) for name in ("a", "b")]
    kept = [tenant_key("acme", "sessions", "s10", "a"), tenant_key("acme", "sessions", "s2", "a")]
    for key in doomed + kept:
        store.put_bytes(key, key.encode())
    store.put_bytes(tenant_key("acme", "sessions", "s1", "nested", "c"), b"c")
    assert store.delete_prefix(tenant_key("acme", "sessions", "s1")) == 3
    assert store.list(tenant_key("acme")) == sorted(kept)
    assert store.delete_prefix(tenant_key("acme", "sessions", "s1")) == 0


def test_delete_prefix_refuses_the_whole_store(store: ObjectStore) -> None:
    with pytest.raises(ValidationError):
        store.delete_prefix("")


def test_one_tenants_keys_never_list_under_another_tenants_prefix(store: ObjectStore) -> None:
    store.put_bytes(tenant_key("acme", "x"), b"1")
    store.put_bytes(tenant_key("acme2", "x"), b"2")  # "acme" is a string prefix of "acme2"
    assert store.list(tenant_key("acme")) == ["tenants/acme/x"]
    assert store.list(tenant_key("acme2")) == ["tenants/acme2/x"]
    assert store.delete_prefix(tenant_key("acme")) == 1
    assert store.get_bytes(tenant_key("acme2", "x")) == b"2"


@pytest.mark.parametrize("bad", BAD_KEYS.values(), ids=BAD_KEYS.keys())
def test_invalid_keys_are_rejected_by_every_method(
    store: ObjectStore, bad: str, tmp_path: Path
) -> None:
    source = tmp_path / "source"
    source.write_bytes(b"x")
    calls: list[Callable[[], object]] = [
        lambda: store.put_bytes(bad, b"x"),
        lambda: store.get_bytes(bad),
        lambda: store.put_file(bad, source),
        lambda: store.get_file(bad, tmp_path / "target"),
        lambda: store.exists(bad),
        lambda: store.size(bad),
        lambda: store.delete(bad),
    ]
    if bad != "tenants/acme/":  # a prefix may end in one "/"
        calls.append(lambda: store.delete_prefix(bad))
        if bad != "":  # list("") lists everything; delete_prefix("") is refused
            calls.append(lambda: store.list(bad))
    for call in calls:
        with pytest.raises(ValidationError):
            call()
    assert store.list("") == []
    assert set(os.listdir(tmp_path)) <= {"source", "store"}  # nothing written beside the root


def test_content_addressed_blobs_round_trip(store: ObjectStore) -> None:
    data = b"token ids, say"
    key = content_key("acme", data)
    store.put_bytes(key, data)
    assert store.list(tenant_key("acme", "blobs")) == [key]
    assert store.get_bytes(content_key("acme", bytes(data))) == data


# --- keys --------------------------------------------------------------------------------------


def test_tenant_key_joins_validated_segments() -> None:
    assert tenant_key("acme", "sessions", "s1", "ckpt") == "tenants/acme/sessions/s1/ckpt"
    assert tenant_key("acme") == "tenants/acme"


@pytest.mark.parametrize(
    ("tenant", "parts", "message"),
    [
        ("..", (), "is '..'"),
        ("acme", ("a/b",), "contains '/'"),
        ("acme", ("",), "is empty"),
        ("acme", ("x" * 129,), "has 129 characters"),
        ("acme", ("a\x00",), "NUL"),
        ("acme", ("a\\b",), "backslash"),
        ("acme", ("a\x7f",), "control character"),
        ("", ("x",), "is empty"),
    ],
)
def test_tenant_key_rejects_bad_segments(tenant: str, parts: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        tenant_key(tenant, *parts)


def test_a_128_character_segment_is_allowed() -> None:
    assert tenant_key("acme", "x" * 128).endswith("x" * 128)


def test_content_key_is_stable_and_content_addressed() -> None:
    data = b"hello"
    key = content_key("acme", data)
    assert key == "tenants/acme/blobs/" + hashlib.sha256(data).hexdigest()
    assert content_key("acme", b"hello") == key
    assert content_key("acme", b"hello!") != key
    assert content_key("other", data) == key.replace("/acme/", "/other/")


# --- backend specifics -------------------------------------------------------------------------


def test_local_store_never_escapes_its_root_through_a_symlink(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    store = LocalStore(tmp_path / "root")
    (tmp_path / "root" / "tenants").mkdir()
    (tmp_path / "root" / "tenants" / "evil").symlink_to(outside)
    with pytest.raises(ValidationError, match="outside the store root"):
        store.put_bytes("tenants/evil/x", b"x")
    assert os.listdir(outside) == []


def test_local_store_keeps_keys_as_files_under_root(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_bytes("tenants/acme/x", b"1")
    assert (tmp_path / "tenants" / "acme" / "x").read_bytes() == b"1"
    store.delete("tenants/acme/x")
    assert os.listdir(tmp_path) == []  # emptied directories are pruned


def test_s3_uploads_large_files_in_parts(s3_server: SeaweedS3, tmp_path: Path) -> None:
    store = _s3_store(s3_server, multipart_bytes=5 * MB)
    source = tmp_path / "source.bin"
    _write_random(source, 12 * MB)
    store.put_file("big", source)
    etag = store._client.head_object(Bucket=store.bucket, Key="big")["ETag"]
    assert etag.strip('"').endswith("-3")  # a multipart upload's ETag counts its parts


def test_s3_lists_across_small_pages(s3_server: SeaweedS3) -> None:
    store = _s3_store(s3_server, page_size=7)
    keys = [f"p/{i:02d}" for i in range(23)]
    for key in keys:
        store.put_bytes(key, b"")
    assert store.list("p") == keys
    assert store.delete_prefix("p") == 23


def test_s3_page_size_is_checked(s3_server: SeaweedS3) -> None:
    with pytest.raises(ValidationError, match="page_size"):
        _s3_store(s3_server, page_size=1001)


def test_s3_bucket_creation_is_idempotent_and_race_safe(s3_server: SeaweedS3) -> None:
    bucket = "race-" + secrets.token_hex(6)
    barrier = threading.Barrier(4)

    def create() -> S3Store:
        barrier.wait()
        return _s3_store(s3_server, bucket)

    with ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(lambda _: create(), range(4)))
    stores[0].put_bytes("k", b"v")
    assert _s3_store(s3_server, bucket).get_bytes("k") == b"v"
    assert all(s.get_bytes("k") == b"v" for s in stores)


def test_s3_with_wrong_credentials_is_unavailable_not_missing(s3_server: SeaweedS3) -> None:
    with pytest.raises(UnavailableError, match=s3_server.endpoint_url):
        S3Store(s3_server.endpoint_url, "any-bucket", "nobody", "wrong-secret")


def test_store_from_config_picks_the_backend(s3_server: SeaweedS3, tmp_path: Path) -> None:
    local = store_from_config(PlatformConfig(data_dir=tmp_path))
    assert isinstance(local, LocalStore)
    assert local.root == (tmp_path / "storage").resolve()
    config = PlatformConfig(
        data_dir=tmp_path,
        s3_endpoint=s3_server.endpoint_url,
        s3_bucket="from-config",
        s3_access_key=s3_server.access_key,
        s3_secret_key=s3_server.secret_key,
    )
    remote = store_from_config(config)
    assert isinstance(remote, S3Store) and isinstance(remote, ObjectStore)
    remote.put_bytes("k", b"v")
    assert remote.get_bytes("k") == b"v"
