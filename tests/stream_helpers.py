"""hivemind's stream framing written by hand, for tests that feed a handler or a reader raw bytes."""

from hivemind.p2p import P2P

# what hivemind sends after a stream's last frame: an error marker with an empty message
END_OF_STREAM = P2P.ERROR_MARKER + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)


def frames_bytes(frames) -> bytes:
    """hivemind's framing of data frames (marker, 8-byte length, protobuf)."""
    out = b""
    for frame in frames:
        data = frame if isinstance(frame, bytes) else frame.SerializeToString()
        out += P2P.MESSAGE_MARKER + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data
    return out
