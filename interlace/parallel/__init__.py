"""Transports for GPU-initiated peer access: buffers owned by one object, peer address tables."""

from interlace.parallel.peer_buffer import BufferSpec, PeerBuffer, release_shared_buffers, simulated_world

__all__ = ["BufferSpec", "PeerBuffer", "release_shared_buffers", "simulated_world"]
