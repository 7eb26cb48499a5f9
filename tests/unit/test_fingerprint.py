"""Tensor fingerprints: equal exactly when the bits are, whatever was fingerprinted before."""

from __future__ import annotations

import torch

from treadle.gpu_worker import fingerprint


def test_equal_tensors_have_equal_fingerprints() -> None:
    x = torch.randn(300, 700)
    assert fingerprint.tensor_fingerprint(x) == fingerprint.tensor_fingerprint(x.clone())


def test_one_bit_changes_the_fingerprint() -> None:
    x = torch.randn(300, 700)
    for index in (0, 12345, x.numel() - 1):
        y = x.clone()
        y.view(-1).view(torch.int32)[index] ^= 1  # the lowest mantissa bit of one element
        assert fingerprint.tensor_fingerprint(y) != fingerprint.tensor_fingerprint(x)


def test_sign_of_zero_and_element_order_count() -> None:
    assert fingerprint.tensor_fingerprint(torch.tensor([0.0])) != fingerprint.tensor_fingerprint(
        torch.tensor([-0.0])
    )
    x = torch.tensor([1.0, 2.0])
    assert fingerprint.tensor_fingerprint(x) != fingerprint.tensor_fingerprint(x.flip(0))


def test_a_weight_depends_only_on_its_index() -> None:
    x = torch.randn(5, 100_000)
    before = fingerprint.tensor_fingerprint(x)
    fingerprint._weights.clear()
    fingerprint.tensor_fingerprint(torch.randn(3))  # grow the weights from a small size again
    assert fingerprint.tensor_fingerprint(x) == before


def test_named_digest_covers_names_shapes_and_missing_tensors() -> None:
    x = torch.randn(4, 6)
    base = fingerprint.of([("a", x), ("b", None)])
    assert fingerprint.of([("a", x.clone()), ("b", None)]) == base
    assert fingerprint.of([("a2", x), ("b", None)]) != base
    assert fingerprint.of([("a", x.reshape(6, 4)), ("b", None)]) != base
    assert fingerprint.of([("a", x), ("b", torch.zeros(1))]) != base
    assert base.startswith(fingerprint.VERSION + ":")
