"""The collector's own order (gpulet_common.ordering): sequences, never clocks."""

from __future__ import annotations

from gpulet_common.ordering import MAX_BOOTS, SenderOrder


def test_a_message_older_than_the_newest_of_its_boot_is_dropped() -> None:
    order = SenderOrder()
    assert order.accept("a", 5)
    assert not order.accept("a", 5)  # the same one again (a request's answer, say)
    assert not order.accept("a", 3)  # delivered late
    assert order.accept("a", 6)


def test_a_restarted_sender_is_believed_from_its_first_message() -> None:
    order = SenderOrder()
    assert order.accept("old", 1000)
    assert order.accept("new", 1)
    assert order.accept("new", 2)
    # A late message of the old process, older than what was seen of it: dropped.
    assert not order.accept("old", 999)


def test_a_forged_boot_cannot_evict_the_real_one_at_once() -> None:
    order = SenderOrder()
    assert order.accept("real", 10)
    assert order.accept("forged", 2**62)
    assert order.accept("real", 11)  # the real sender goes on regardless
    assert not order.accept("real", 9)
    for n in range(MAX_BOOTS):
        order.accept(f"boot-{n}", 1)
    # Only after MAX_BOOTS other boots is "real" forgotten (then treated as new).
    assert order.accept("real", 9)


def test_an_unsequenced_sender_is_accepted() -> None:
    order = SenderOrder()
    assert order.accept("", 0)
    assert order.accept("", 0)
