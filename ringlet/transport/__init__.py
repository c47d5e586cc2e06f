"""Moving bytes between two ranks: shared-memory rings inside a host (shm.py), sockets
between hosts (tcp.py), one packet protocol over both (protocol.py), the engine that drives
them (engine.py), its background progress thread (progress.py) and the C fast path of
small calls (fast.py, _fastpath.c)."""
