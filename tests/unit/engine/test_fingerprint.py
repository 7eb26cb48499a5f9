"""Tensor fingerprints: equal exactly when the bits are, whatever was fingerprinted before."""

from __future__ import annotations

import torch

from treadle.engine.memory import fingerprint


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


def test_fingerprints_never_change() -> None:
    # Logged with every state-changing operation and checked on replay: pinned values.
    g = torch.Generator().manual_seed(12)
    named: list[tuple[str, torch.Tensor | None]] = [
        (f"t{i}", torch.randn(n, generator=g)) for i, n in enumerate([3, 256, 512, 1024, 70_000])
    ]
    named.append(("none", None))
    named.append(("half", torch.randn(40, generator=g).to(torch.bfloat16)))
    named.append(("half2", torch.randn(30, generator=g).to(torch.bfloat16)))
    named.append(("ints", torch.arange(-50, 50, dtype=torch.int64)))
    assert [fingerprint.tensor_fingerprint(t) for _, t in named if t is not None] == [
        230513470141685030,
        5433041930328390075,
        5367503012211743700,
        7673837800848750152,
        -5296909200715590729,
        6249288785088647057,
        6634736282400627205,
        2986473558754104170,
    ]
    assert fingerprint.of(named) == "fp1:c6b9e9cbac83d3b7c5d99b68eb7d643c"


def test_small_tensors_fingerprinted_together_equal_one_by_one() -> None:
    g = torch.Generator().manual_seed(3)
    groups = [
        [torch.randn(n, generator=g) for n in (1, 7, 256, 512, 1000, 16_384)],
        [torch.randn(5, 9, generator=g).T, torch.randn(3, 4, generator=g)[:, ::2]],  # strided
        [torch.randn(4, 8, generator=g, requires_grad=True) for _ in range(3)],
        [torch.randn(n, generator=g).to(torch.bfloat16) for n in (2, 33, 600)],
        [torch.randint(-(2**62), 2**62, (n,), generator=g) for n in (1, 10, 300)],
        [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in (5, 6)],
    ]
    for tensors in groups:
        assert fingerprint.fingerprints_together(tensors) == [
            fingerprint.tensor_fingerprint(t) for t in tensors
        ]


def test_fingerprinting_leaves_the_tensor_as_it_was() -> None:
    for tensor in (
        torch.arange(-50, 50, dtype=torch.int64),
        torch.randn(300, dtype=torch.float64),
        torch.randn(300),
    ):
        before = tensor.clone()
        first = fingerprint.tensor_fingerprint(tensor)
        assert torch.equal(tensor, before)
        assert fingerprint.tensor_fingerprint(tensor) == first
        assert fingerprint.of([("x", tensor), ("y", tensor)]).startswith(fingerprint.VERSION)
        assert torch.equal(tensor, before)
