#!/usr/bin/env python3
"""A TCP relay that adds a fixed one-way delay in each direction.

  delay_proxy.py LISTEN_PORT UPSTREAM_HOST UPSTREAM_PORT DELAY_MS

Listens on 127.0.0.1:LISTEN_PORT. Every chunk read from one side is sent
to the other DELAY_MS after it arrived (chunks keep their order and are
not held back by each other: a queue of due times, not a sleep per chunk),
so each request/response round trip costs 2 x DELAY_MS more while the
throughput is left to the link. bench/lazy.sh uses it where the kernel
has no netem qdisc.
"""

import collections
import socket
import sys
import threading
import time


def pipe(src, dst, delay):
    q = collections.deque()
    cv = threading.Condition()
    done = [False]

    def reader():
        try:
            while True:
                b = src.recv(1 << 16)
                if not b:
                    break
                with cv:
                    q.append((time.monotonic() + delay, b))
                    cv.notify()
        except OSError:
            pass
        with cv:
            done[0] = True
            cv.notify()

    def writer():
        try:
            while True:
                with cv:
                    while not q and not done[0]:
                        cv.wait()
                    if not q:
                        break
                    due, b = q.popleft()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                dst.sendall(b)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    threading.Thread(target=reader, daemon=True).start()
    threading.Thread(target=writer, daemon=True).start()


def main():
    port, host, uport, delay = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]) / 1000
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(128)
    while True:
        c, _ = ls.accept()
        try:
            u = socket.create_connection((host, uport))
        except OSError:
            c.close()
            continue
        for s in (c, u):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pipe(c, u, delay)
        pipe(u, c, delay)


if __name__ == "__main__":
    main()
