"""Small arithmetic helpers whose failures say which numbers were wrong."""

from __future__ import annotations


def div_even(a: int, b: int, what: str = "value") -> int:
    """a // b, refusing a remainder: sharding never silently drops rows."""
    if b <= 0 or a % b != 0:
        raise ValueError(f"{what}: {a} is not divisible by {b}")
    return a // b


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b
