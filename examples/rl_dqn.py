"""DQN on a gymnasium environment as a job of roles (``examples/rl_dqn.toml``): see convoy/workloads/rl/README.md.

    convoy run examples/rl_dqn.toml
    convoy run examples/rl_dqn.toml --set env=Acrobot-v1 --set stop_return=-100
"""

from __future__ import annotations

import sys

from convoy.workloads.rl.job import main

if __name__ == "__main__":
    sys.exit(main())
