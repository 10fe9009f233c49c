"""Arena: free pages can be handed back to the OS without touching allocated blocks."""
from __future__ import annotations

from outcore.offload.store.arena import Arena


def test_discard_free_returns_free_pages_and_keeps_blocks():
    """Free ranges read back as zeros after a discard (their pages went back to the OS);
    allocated blocks keep their bytes; the arena still allocates there."""
    from outcore.offload.aligned import aligned_empty

    arena = Arena(64 * 4096, aligned_empty)
    kept, dropped = arena.alloc(16 * 4096), arena.alloc(16 * 4096)
    arena.bytes_of(kept).fill_(7)
    arena.bytes_of(dropped).fill_(9)
    arena.free(dropped)
    assert arena.discard_free() == 48 * 4096  # the freed block and the never-used rest
    assert bool((arena.bytes_of(kept) == 7).all())
    again = arena.alloc(16 * 4096)
    assert again.offset == dropped.offset and bool((arena.bytes_of(again) == 0).all())
