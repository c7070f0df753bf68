"""Stage 1 checks: the naive contiguous allocator (reservation policies, free holes, first-fit)."""

from __future__ import annotations

import random

from tinypaged import contiguous
from tinypaged.checks import register


def _expect(got, want, what: str) -> None:
    assert got == want, f"{what}: expected {want!r}, got {got!r}"


@register("01", "reservation_tokens", reference=lambda: contiguous.reservation_tokens)
def check_reservation_tokens(reservation_tokens) -> None:
    """``reservation_tokens(policy, final_len, max_model_len)``: slots reserved at admission."""
    for final_len in (1, 7, 100, 2048):
        _expect(reservation_tokens("max", final_len, 2048), 2048, f"policy 'max', final_len={final_len}")
    _expect(reservation_tokens("max", 30, 512), 512, "policy 'max' reserves max_model_len")
    for final_len, want in ((1, 1), (2, 2), (3, 4), (5, 8), (64, 64), (65, 128), (300, 512), (1025, 2048)):
        _expect(reservation_tokens("pow2", final_len, 2048), want, f"policy 'pow2', final_len={final_len}")
    _expect(reservation_tokens("pow2", 300, 400), 400, "policy 'pow2' never reserves more than max_model_len")
    for final_len in (1, 17, 300, 2048):
        _expect(reservation_tokens("oracle", final_len, 2048), final_len, f"policy 'oracle', final_len={final_len}")
    _expect(reservation_tokens("oracle", 3000, 2048), 2048, "policy 'oracle' caps the reservation at max_model_len")
    try:
        reservation_tokens("best-guess", 10, 2048)
    except ValueError:
        pass
    else:
        raise AssertionError("an unknown policy should raise ValueError")


def _random_regions(rng: random.Random, capacity: int) -> list[tuple[int, int]]:
    regions, cursor = [], rng.randrange(0, 3)
    while cursor < capacity:
        size = rng.randrange(1, 6)
        if cursor + size > capacity:
            break
        regions.append((cursor, size))
        cursor += size + rng.choice((0, 0, 1, 2, 5))
    return regions


@register("01", "free_holes", reference=lambda: contiguous.free_holes)
def check_free_holes(free_holes) -> None:
    """``free_holes(regions, capacity)``: the gaps between sorted (start, size) regions, in address order."""
    _expect(free_holes([], 10), [(0, 10)], "an empty arena is one hole")
    _expect(free_holes([(0, 10)], 10), [], "a full arena has no holes")
    _expect(free_holes([(0, 4), (4, 6)], 10), [], "adjacent regions leave no hole between them")
    _expect(free_holes([(2, 3)], 10), [(0, 2), (5, 5)], "holes before and after one region")
    _expect(free_holes([(0, 2), (5, 1), (8, 2)], 10), [(2, 3), (6, 2)], "holes between regions")
    rng = random.Random(1)
    for _ in range(200):
        capacity = rng.randrange(1, 40)
        regions = _random_regions(rng, capacity)
        want = contiguous.free_holes(regions, capacity)
        got = free_holes(list(regions), capacity)
        _expect(got, want, f"free_holes({regions}, {capacity})")


@register("01", "first_fit", reference=lambda: contiguous.first_fit)
def check_first_fit(first_fit) -> None:
    """``first_fit(holes, size)``: the start of the FIRST hole large enough, or None."""
    holes = [(0, 2), (5, 8), (20, 3), (30, 10)]
    _expect(first_fit(holes, 1), 0, "size 1 fits the first hole")
    _expect(first_fit(holes, 2), 0, "a hole exactly the size fits")
    _expect(first_fit(holes, 3), 5, "size 3 skips the 2-slot hole")
    _expect(first_fit(holes, 9), 30, "size 9 fits only the last hole")
    _expect(first_fit([(0, 10), (20, 3)], 3), 0, "first-fit takes the first hole, not the tightest (best-fit)")
    _expect(first_fit(holes, 11), None, "no hole of 11: None, although 23 slots are free in total")
    _expect(first_fit([], 1), None, "no holes at all: None")
    rng = random.Random(2)
    for _ in range(200):
        capacity = rng.randrange(1, 60)
        holes = contiguous.free_holes(_random_regions(rng, capacity), capacity)
        size = rng.randrange(1, 8)
        _expect(first_fit(list(holes), size), contiguous.first_fit(holes, size), f"first_fit({holes}, {size})")
