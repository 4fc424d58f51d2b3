"""GRPO fine-tuning of SmolLM2-135M-Instruct on arithmetic as a job of roles (``examples/grpo.toml``): see
convoy/workloads/rlhf/README.md.

    convoy run examples/grpo.toml
    convoy run examples/grpo.toml --set max_lag=0 --set steps=30
"""

from __future__ import annotations

import sys

from convoy.workloads.rlhf.job import main

if __name__ == "__main__":
    sys.exit(main())
