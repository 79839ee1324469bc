"""`python -m vllm_sim ...`: serve one simulated vLLM pod."""

import sys

from vllm_sim.cli import main

sys.exit(main(sys.argv[1:]) or 0)
