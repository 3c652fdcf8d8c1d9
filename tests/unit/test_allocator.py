import pytest

from pd_serve.cache.allocator import PageAllocator


def test_allocate_until_full_then_none():
    alloc = PageAllocator(4)
    a = alloc.allocate(3)
    assert sorted(a) == [0, 1, 2] and alloc.num_free_pages == 1
    assert not alloc.can_allocate(2)
    assert alloc.allocate(2) is None  # out of room is a value, not an exception
    assert alloc.num_free_pages == 1
    alloc.free(a)
    assert alloc.num_free_pages == 4


def test_refcount_keeps_shared_page_until_last_free():
    alloc = PageAllocator(2)
    (page,) = alloc.allocate(1)
    alloc.incref([page])
    alloc.free([page])
    assert alloc.num_free_pages == 1  # still held by the second reference
    alloc.free([page])
    assert alloc.num_free_pages == 2


def test_double_free_and_incref_of_free_page_raise():
    alloc = PageAllocator(2)
    pages = alloc.allocate(1)
    alloc.free(pages)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(pages)
    with pytest.raises(RuntimeError, match="incref of free page"):
        alloc.incref(pages)


def test_pages_are_distinct_across_allocations():
    alloc = PageAllocator(10)
    got = alloc.allocate(4) + alloc.allocate(6)
    assert sorted(got) == list(range(10))
