"""Route tokens (epp.routing.accounting.RandomHex): 12 random bytes each as 24 hex digits,
read from the OS in batches, never repeated, and never shared with a forked child."""

from __future__ import annotations

import os
import re

from epp.routing.accounting import RandomHex


def test_tokens_are_24_hex_digits_and_distinct_across_batches():
    source = RandomHex()
    tokens = [source.take() for _ in range(3 * RandomHex.BATCH + 7)]
    assert all(re.fullmatch(r"[0-9a-f]{24}", t) for t in tokens)
    assert len(set(tokens)) == len(tokens)


def test_a_forked_child_reads_its_own_random_bytes():
    source = RandomHex()
    source.take()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next token must not be the parent's next one
        os.write(write, source.take().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    os.close(write)
    assert re.fullmatch(r"[0-9a-f]{24}", child)
    assert child != source.take()
