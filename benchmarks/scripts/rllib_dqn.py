"""RLlib's DQN on CartPole-v1 with the config of its own tuned example (``rllib/examples/algorithms/dqn/cartpole_dqn.py``:
prioritized replay of 50,000, alpha 0.6, beta 0.4, n-step 2-5, double and dueling Q, 256-unit tanh layers, epsilon
1.0 -> 0.02 over 10,000 steps, lr 5e-4, batches of 32), the peer of ``benchmarks/rl.py``'s learning target.

    python benchmarks/scripts/rllib_dqn.py --seed S --reward 475 --max-steps 150000

Prints one line per training iteration, ``rllib: steps N return R wall W``, and at the end
``rllib: reached R at N steps in W s`` or ``rllib: not reached by N steps (W s)``.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reward", type=float, default=475.0)
    parser.add_argument("--max-steps", type=int, default=150_000)
    parser.add_argument("--env-runners", type=int, default=1)
    args = parser.parse_args()

    import ray
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    began = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = (
        DQNConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=args.env_runners)
        .debugging(seed=args.seed)
        .training(lr=0.0005, train_batch_size_per_learner=32,
                  replay_buffer_config={"type": "PrioritizedEpisodeReplayBuffer", "capacity": 50000, "alpha": 0.6,
                                        "beta": 0.4},
                  n_step=(2, 5), double_q=True, dueling=True, num_atoms=1, noisy=False,
                  epsilon=[(0, 1.0), (10000, 0.02)])
        .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[256], fcnet_activation="tanh",
                                                   fcnet_bias_initializer="zeros_",
                                                   head_fcnet_bias_initializer="zeros_", head_fcnet_hiddens=[256]))
    )
    algo = config.build_algo()
    steps, mean = 0, float("nan")
    while steps < args.max_steps:
        result = algo.train()
        steps = int(result["num_env_steps_sampled_lifetime"])
        mean = float(result["env_runners"].get("episode_return_mean", float("nan")))
        print(f"rllib: steps {steps} return {mean:.1f} wall {time.monotonic() - began:.1f}", flush=True)
        if mean >= args.reward:
            print(f"rllib: reached {mean:.1f} at {steps} steps in {time.monotonic() - began:.1f} s", flush=True)
            break
    else:
        print(f"rllib: not reached by {steps} steps ({time.monotonic() - began:.1f} s)", flush=True)
    algo.stop()
    ray.shutdown()


if __name__ == "__main__":
    main()
