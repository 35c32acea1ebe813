"""BlockAllocator invariants: free + used = total, no block owned twice, block 0 reserved."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_router.core.block_allocator import BlockAllocator, BlockAllocatorError


def test_block_zero_is_reserved_and_all_others_usable() -> None:
    allocator = BlockAllocator(num_blocks=5, block_size=4)
    assert allocator.total == 4
    blocks = allocator.allocate(16)
    assert blocks is not None and sorted(blocks) == [1, 2, 3, 4]
    assert allocator.free_count == 0
    assert allocator.allocate(1) is None


def test_allocates_ceil_of_tokens_over_block_size() -> None:
    allocator = BlockAllocator(num_blocks=100, block_size=16)
    assert allocator.blocks_for(1) == 1
    assert allocator.blocks_for(16) == 1
    assert allocator.blocks_for(17) == 2
    blocks = allocator.allocate(33)
    assert blocks is not None and len(blocks) == 3
    assert allocator.used_count == 3


def test_failed_allocation_takes_nothing() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    assert allocator.allocate(7) is None
    assert allocator.free_count == 3


def test_max_blocks_caps_the_pool() -> None:
    allocator = BlockAllocator(num_blocks=100, block_size=8, max_blocks=10)
    assert allocator.total == 10
    assert allocator.allocate(81) is None
    assert allocator.allocate(80) is not None


def test_double_free_and_foreign_free_are_refused_without_side_effects() -> None:
    allocator = BlockAllocator(num_blocks=10, block_size=1)
    blocks = allocator.allocate(3)
    assert blocks is not None
    allocator.free(blocks)
    with pytest.raises(BlockAllocatorError):
        allocator.free(blocks)
    with pytest.raises(BlockAllocatorError):
        allocator.free([0])
    held = allocator.allocate(2)
    assert held is not None
    # One good block and one bad: nothing is freed.
    with pytest.raises(BlockAllocatorError):
        allocator.free([held[0], 99])
    assert allocator.is_allocated(held[0])
    with pytest.raises(BlockAllocatorError):
        allocator.free([held[0], held[0]])
    assert allocator.used_count == 2


@pytest.mark.parametrize(("num_blocks", "block_size"), [(1, 16), (0, 16), (10, 0)])
def test_bad_geometry_is_rejected(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockAllocator(num_blocks, block_size)


def test_zero_token_allocation_is_rejected() -> None:
    with pytest.raises(ValueError):
        BlockAllocator(4, 4).allocate(0)


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(2, 40),
    block_size=st.sampled_from([1, 2, 16]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 80)), max_size=60),
)
def test_random_allocate_free_keeps_invariants(
    num_blocks: int, block_size: int, ops: list[tuple[bool, int]]
) -> None:
    allocator = BlockAllocator(num_blocks, block_size)
    owned: list[list[int]] = []
    for allocate, n in ops:
        if allocate or not owned:
            blocks = allocator.allocate(n)
            expected = -(-n // block_size)
            if blocks is None:
                assert expected > allocator.free_count
            else:
                assert len(blocks) == expected
                owned.append(blocks)
        else:
            allocator.free(owned.pop(n % len(owned)))
        flat = [b for blocks in owned for b in blocks]
        assert len(flat) == len(set(flat)), "a block is owned twice"
        assert all(1 <= b <= num_blocks - 1 for b in flat)
        assert allocator.used_count == len(flat)
        assert allocator.free_count + allocator.used_count == allocator.total == num_blocks - 1
    for blocks in owned:
        allocator.free(blocks)
    assert allocator.free_count == allocator.total
