"""TRL's ``GRPOTrainer`` on the GRPO job's task: the peer of ``benchmarks/rlhf.py``'s TRL section.

    python benchmarks/scripts/rlhf_trl.py --steps S [--set key=value ...] [--no-gradient-checkpointing] [--float32]

The same model (SmolLM2-135M-Instruct, the float32 directory convoy converts it to), the same task and checker, group
size, prompts per step, response length, temperature, learning rate (constant), KL weight, clip and gradient bound as
``examples/grpo.toml`` with the same ``--set`` overrides; everything else as TRL's ``GRPOConfig`` has it: its loss,
its reward scaling, bf16 autocast over float32 weights (``--float32`` turns it off) and gradient checkpointing
(``--no-gradient-checkpointing``). On a CPU as TRL's users run it there: ``use_cpu``, no vLLM, one process on every
core. Held out: the same problems, answered greedily and scored by the same function as the convoy job's trainer
does.

Prints ``trl: step N reward R`` as TRL logs each step, then
``trl: S samples in T s (training A s, evaluation E s), held-out reward H%``.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def job_settings(overrides: list[str]) -> object:
    """The example job's ``[train]`` table with ``--set`` overrides, as convoy's GRPOConfig reads them."""
    from convoy.workloads.rlhf.config import GRPOConfig

    table = tomllib.loads((REPO / "examples" / "grpo.toml").read_text())["train"]
    cfg = GRPOConfig()
    kinds = {field.name: type(getattr(cfg, field.name)) for field in dataclasses.fields(cfg)}
    for key, value in table.items():
        setattr(cfg, key, value)
    for pair in overrides:
        key, _, value = pair.partition("=")
        setattr(cfg, key, kinds[key](value))
    cfg.validate()
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--set", action="append", default=[], help="a [train] setting, as convoy run --set takes")
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--float32", action="store_true")
    args = parser.parse_args()
    cfg = job_settings([f"steps={args.steps}", *args.set])

    import datasets
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    from convoy.workloads.lookahead.model import model_dir
    from convoy.workloads.rlhf.evaluate import held_out_reward
    from convoy.workloads.rlhf.task import Arithmetic, reward

    hf_logging.set_verbosity_error()
    task = Arithmetic(cfg.seed, cfg.low, cfg.high, cfg.ops)
    prompts = [task.prompt(number) for number in range(cfg.steps * cfg.groups_per_step)]
    data = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": p.text}], "answer": p.answer}
                                       for p in prompts])

    def checker(completions: list[list[dict[str, str]]], answer: list[int], **_: object) -> list[float]:
        return [reward(completion[0]["content"], right) for completion, right in zip(completions, answer, strict=True)]

    class Said(TrainerCallback):
        def on_log(self, _args: object, state: object, _control: object, logs: dict | None = None, **_: object) -> None:
            if logs and "reward" in logs:
                print(f"trl: step {state.global_step} reward {logs['reward']:.3f}", flush=True)  # type: ignore[attr-defined]

    with tempfile.TemporaryDirectory(prefix="convoy-bench-trl-") as out:
        config = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=not args.float32, report_to="none", save_strategy="no", logging_steps=1,
            disable_tqdm=True, seed=cfg.seed, max_steps=cfg.steps, num_generations=cfg.group_size,
            per_device_train_batch_size=cfg.group_size * cfg.groups_per_step, max_completion_length=cfg.max_new_tokens,
            temperature=cfg.temperature, learning_rate=cfg.lr, lr_scheduler_type="constant", beta=cfg.beta,
            epsilon=cfg.clip, max_grad_norm=cfg.max_grad_norm, model_init_kwargs={"dtype": "float32"},
            gradient_checkpointing=not args.no_gradient_checkpointing)
        trainer = GRPOTrainer(model=str(model_dir(cfg.model)), reward_funcs=[checker], args=config,
                              train_dataset=data, callbacks=[Said()])
        began = time.monotonic()
        trainer.train()
        trained = time.monotonic() - began
        model, tokenizer = trainer.model, trainer.processing_class
        value, _ = held_out_reward(model, tokenizer, task.held_out(cfg.eval_prompts), cfg.max_new_tokens, reward)
        total = time.monotonic() - began
    samples = cfg.steps * cfg.groups_per_step * cfg.group_size
    print(f"trl: {samples} samples in {total:.1f} s (training {trained:.1f} s, evaluation {total - trained:.1f} s), "
          f"held-out reward {100 * value:.1f}%", flush=True)


if __name__ == "__main__":
    main()
