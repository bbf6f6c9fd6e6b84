"""Taking a port beside the engine before (SO_REUSEPORT) so that the new engine gets every new connection.

By default the kernel spreads a port's new connections over all its SO_REUSEPORT listeners by a hash of
the client's address: the old engine keeps being handed about half of them until it closes, and closing
resets those still queued on it.  A one-instruction classic BPF program on the port's group (no privilege
needed) returns the index of the listener that should take each connection: the newest one's.  Where the
index is out of range (the old engine gone, the new one alone at index 0) the kernel falls back to the
hash, so the program left on the group is harmless, and routes to the next engine that joins at index 1.
"""
from __future__ import annotations

import ctypes
import os
import socket
import struct

from restartkit.process.procfs import tcp_sockets

SO_ATTACH_REUSEPORT_CBPF = getattr(socket, "SO_ATTACH_REUSEPORT_CBPF", 51)
BPF_RET_K = 0x06  # BPF_RET | BPF_K: return the constant k


def group_index(sock: socket.socket) -> int | None:
    """This listener's index in its port's group: how many listeners of this user on the same address
    and port came before it (the kernel appends a new one).  None when /proc does not show it."""
    inode = str(os.fstat(sock.fileno()).st_ino)
    rows = tcp_sockets(("/proc/net/tcp6",) if sock.family == socket.AF_INET6 else ("/proc/net/tcp",))
    mine = next((r for r in rows if r[9] == inode), None)
    if mine is None:
        return None
    return sum(1 for r in rows if r[3] == "0A" and r[1] == mine[1] and r[7] == mine[7]) - 1


def take_new_connections(sock: socket.socket) -> bool:
    """After listen(): route the port's new connections to this listener.  False when it is alone (the
    hash has no one else to choose) or the kernel refused the program (the hash spreads them then)."""
    index = group_index(sock)
    if not index:
        return False
    insn = (ctypes.c_ubyte * 8).from_buffer_copy(struct.pack("=HBBI", BPF_RET_K, 0, 0, index))
    prog = struct.pack("@HP", 1, ctypes.addressof(insn))  # struct sock_fprog {len; filter*}: copied by the kernel
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, prog)
    except OSError:
        return False
    return True
