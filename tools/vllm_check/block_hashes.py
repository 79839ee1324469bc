"""vLLM's own prefix-cache block hashes for token sequences, computed by vLLM's code.

Runs in the vLLM venv, as a filter: one JSON list of token ids per input line, one JSON
list of hashes per output line (each full block's hash, as the engine's KV events carry
it: the low 64 bits of the digest, 16 hex digits). Extra keys (LoRA, cache_salt,
multimodal) are not supported: the callers send plain token prompts.

    .bench/vllm-venv/bin/python tools/vllm_check/block_hashes.py --block-size 32

tests/e2e/test_vllm_precise_e2e.py uses it to name the blocks a probe shows an engine
holds, without reading the KV events the EPP reads. It must run with the same hash
algorithm (`--prefix-caching-hash-algo`, default sha256) and PYTHONHASHSEED as the engine.
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--algo", default="sha256", help="the engine's hash algorithm")
    args = parser.parse_args()

    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    hash_fn = get_hash_fn_by_name(args.algo)
    kcu.init_none_hash(hash_fn)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        tokens = json.loads(line)
        out, parent = [], None
        for start in range(0, len(tokens) - args.block_size + 1, args.block_size):
            parent = kcu.hash_block_tokens(
                hash_fn, parent, tokens[start : start + args.block_size], None
            )
            external = kcu.maybe_convert_block_hash(parent)
            value = external if isinstance(external, int) else int.from_bytes(external[-8:])
            out.append(f"{value:016x}")
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
