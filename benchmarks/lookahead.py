"""Lookahead decoding vs Hugging Face greedy ``generate`` and HF prompt lookup, SmolLM2-135M-Instruct on the CPU.

Three prompt families (benchmarks/lookahead_prompts.py): retrieval-style QA over a passage, a code edit of a
snippet, open-ended stories; 128 new tokens each, with 1 and 2 threads. For every prompt the decoders (HF greedy,
HF prompt lookup, convoy, and HF greedy and HF prompt lookup on convoy's packed weights) run back to back, order
rotated per repeat, after a warm-up (convoy packs its weights for oneDNN then, ``packed.py``; the cost of a pass of
n tokens, stock and packed, is printed per thread count). A family's speed is its total tokens over its total
time, the median over repeats. Forward passes are counted with a hook on the model's decoder stack, so tokens
per pass is measured the same way for all. convoy's memory of earlier outputs starts empty for each family in
each repeat (so a repeat never meets its own earlier answer).

    python benchmarks/lookahead.py            # full: 4 prompts per family, 1 and 2 threads, 3 repeats (~40 min)
    python benchmarks/lookahead.py --quick    # 1 prompt per family, 48 tokens, 2 threads (< 1 min)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lookahead_prompts import FAMILIES  # noqa: E402

from convoy.workloads.lookahead.generator import LookaheadGenerator  # noqa: E402
from convoy.workloads.lookahead.model import load_model  # noqa: E402
from convoy.workloads.lookahead.packed import PackedLinears  # noqa: E402
from convoy.workloads.lookahead.verify import cache_argument, new_cache  # noqa: E402

METHODS = ("greedy", "prompt-lookup", "convoy", "greedy-packed", "lookup-packed")
"""``greedy-packed`` and ``lookup-packed`` are HF greedy ``generate`` and HF prompt lookup on convoy's packed weights,
so the kernels are the same on both sides: convoy / greedy-packed is what drafting gives over none, convoy /
lookup-packed what convoy's drafting gives over HF's, and the targets against prompt lookup use that row."""
LOOKUP_TOKENS = 10  # HF prompt lookup's draft length, as its documentation's example
GOAL_RETRIEVAL_VS_GREEDY = 2.5
GOAL_VS_LOOKUP = 1.1
GOAL_STORY_VS_GREEDY = 0.95


class PassCounter:
    """Counts forward calls of the model's decoder stack (one per decoding pass, plus the prompt's), which every
    decoder here runs once per pass (convoy calls it directly, to run the vocabulary head on fewer rows)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        model.get_decoder().register_forward_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self.calls += 1


def run_one(method: str, model, generator: LookaheadGenerator, ids: list[int], new_tokens: int,
            counter: PassCounter) -> tuple[list[int], float, int]:
    """(tokens, seconds, passes after the prompt's) for one prompt."""
    tensor = torch.tensor([ids])
    counter.calls = 0
    started = time.perf_counter()
    if method == "convoy":
        tokens = generator.generate(tensor, max_new_tokens=new_tokens).tokens[0]
    else:
        extra = {"prompt_lookup_num_tokens": LOOKUP_TOKENS} if "lookup" in method else {}
        packed = PackedLinears.of(model) if method.endswith("-packed") else contextlib.nullcontext()
        with torch.inference_mode(), packed:
            out = model.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=new_tokens,
                                 do_sample=False, **extra)
        tokens = out[0, len(ids):].tolist()
    return tokens, time.perf_counter() - started, counter.calls - 1


def pass_costs(model, ids: list[int], sizes: tuple[int, ...] = (1, 2, 9, 17, 33), reps: int = 7) -> str:
    """Median time of one pass of n tokens after the prompt ``ids``, stock weights and packed (``packed.py``):
    what a draft of n - 1 tokens costs against a one-token step, the number the adaptive draft size trades on."""
    cache = new_cache(model)
    argument = {cache_argument(model): cache, "use_cache": True}
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), **argument)
        times = {}
        for label, context in (("stock", contextlib.nullcontext()), ("packed", PackedLinears.of(model))):
            with context:
                for n in sizes:
                    step = torch.tensor([ids[:n]])
                    samples = []
                    for _ in range(reps):
                        began = time.perf_counter()
                        model(input_ids=step, **argument)
                        samples.append(time.perf_counter() - began)
                        cache.crop(-n)
                    times[label, n] = statistics.median(samples) * 1e3
    one = times["stock", 1]
    return "; ".join(f"{n} token(s) {times['stock', n]:.0f} / {times['packed', n]:.0f} ms "
                     f"({times['stock', n] / one:.2f}x / {times['packed', n] / one:.2f}x)" for n in sizes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 prompt per family, 48 tokens, 2 threads, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    prompts_per_family, repeats, new_tokens = 4, args.repeats, args.new_tokens
    threads_list = [int(value) for value in args.threads.split(",")]
    if args.quick:
        prompts_per_family, repeats, new_tokens, threads_list = 1, 1, 48, [2]
    model, tokenizer = load_model()
    counter = PassCounter(model)
    encoded = {family: [list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=True)["input_ids"])
                        for prompt in prompts[:prompts_per_family]]
               for family, prompts in FAMILIES.items()}
    lengths = [len(ids) for rows in encoded.values() for ids in rows]
    print(f"SmolLM2-135M-Instruct fp32, {new_tokens} new tokens, prompts of {min(lengths)}-{max(lengths)} tokens, "
          f"{prompts_per_family} per family, {repeats} repeat(s), threads {threads_list}", flush=True)
    # speed[(threads, family, method)] = [family tokens/s per repeat]; passes likewise (tokens per pass)
    speed: dict[tuple[int, str, str], list[float]] = {}
    per_pass: dict[tuple[int, str, str], list[float]] = {}
    mismatches: list[str] = []
    for threads in threads_list:
        torch.set_num_threads(threads)
        warm = encoded["story"][0][:32]
        run_one("greedy", model, None, warm, 8, counter)  # warm up the kernels, and pack convoy's weights
        run_one("convoy", model, LookaheadGenerator(model, tokenizer), warm, 8, counter)
        print(f"  threads {threads}, one pass after {len(encoded['retrieval'][0])} tokens, stock / packed weights "
              f"(x a one-token stock pass): {pass_costs(model, encoded['retrieval'][0])}", flush=True)
        for repeat in range(repeats):
            for family, rows in encoded.items():
                generator = LookaheadGenerator(model, tokenizer)
                totals = {method: [0, 0.0, 0] for method in METHODS}
                for index, ids in enumerate(rows):
                    shift = (repeat + index) % len(METHODS)
                    outputs = {}
                    for method in METHODS[shift:] + METHODS[:shift]:
                        tokens, seconds, passes = run_one(method, model, generator, ids, new_tokens, counter)
                        outputs[method] = tokens
                        total = totals[method]
                        total[0], total[1], total[2] = total[0] + len(tokens), total[1] + seconds, total[2] + passes
                    for method in ("prompt-lookup", "convoy"):
                        if outputs[method] != outputs["greedy"]:
                            mismatches.append(f"{method} {family}[{index}] threads={threads}")
                    for method in ("greedy-packed", "lookup-packed"):
                        if outputs[method] != outputs["greedy"]:
                            print(f"  note: {method} differs from greedy in {family}[{index}] threads={threads} "
                                  "(float32 summation order on the packed weights)")
                for method, (tokens, seconds, passes) in totals.items():
                    speed.setdefault((threads, family, method), []).append(tokens / seconds)
                    per_pass.setdefault((threads, family, method), []).append((tokens - len(rows)) / passes)
            print(f"  threads {threads} repeat {repeat + 1}/{repeats} done", flush=True)
    return report(speed, per_pass, mismatches, threads_list)


def report(speed, per_pass, mismatches: list[str], threads_list: list[int]) -> int:
    print(f"\n{'threads':>7} {'family':<10} {'method':<14} {'tokens/s':>9} {'tok/pass':>9} {'vs greedy':>10} "
          f"{'vs lookup':>10} {'vs greedy-packed':>16} {'vs lookup-packed':>16}")
    ratios: dict[tuple[int, str, str], float] = {}
    for threads in threads_list:
        for family in FAMILIES:
            median = {m: statistics.median(speed[(threads, family, m)]) for m in METHODS}
            for method in METHODS:
                ratios[(threads, family, f"{method}/greedy")] = median[method] / median["greedy"]
                ratios[(threads, family, f"{method}/lookup")] = median[method] / median["prompt-lookup"]
                ratios[(threads, family, f"{method}/lookup-packed")] = median[method] / median["lookup-packed"]
                print(f"{threads:>7} {family:<10} {method:<14} {median[method]:>9.1f} "
                      f"{statistics.median(per_pass[(threads, family, method)]):>9.2f} "
                      f"{median[method] / median['greedy']:>9.2f}x {median[method] / median['prompt-lookup']:>9.2f}x "
                      f"{median[method] / median['greedy-packed']:>15.2f}x "
                      f"{median[method] / median['lookup-packed']:>15.2f}x")
    print()
    for item in mismatches:
        print(f"MISMATCH: {item} differs from greedy")

    def worst(family: str, ratio: str) -> tuple[float, str]:
        value, threads = min((ratios[(t, family, ratio)], t) for t in threads_list)
        return value, f"{value:.2f}x (worst of threads {','.join(map(str, threads_list))}: {threads})"

    print(f"target identical_to_greedy: {len(mismatches)} differing outputs (goal 0) "
          f"{'met' if not mismatches else 'missed'}")
    value, text = worst("retrieval", "convoy/greedy")
    print(f"target retrieval_vs_greedy: {text} (goal >= {GOAL_RETRIEVAL_VS_GREEDY}x) "
          f"{'met' if value >= GOAL_RETRIEVAL_VS_GREEDY else 'missed'}")
    for family in ("retrieval", "code"):
        stock, _ = worst(family, "convoy/lookup")
        value, text = worst(family, "convoy/lookup-packed")
        print(f"target {family}_vs_prompt_lookup: {text} against HF prompt lookup on the same packed weights "
              f"(on stock weights {stock:.2f}x) (goal >= {GOAL_VS_LOOKUP}x) "
              f"{'met' if value >= GOAL_VS_LOOKUP else 'missed'}")
    value, text = worst("story", "convoy/greedy")
    print(f"target story_vs_greedy: {text} (goal >= {GOAL_STORY_VS_GREEDY}x) "
          f"{'met' if value >= GOAL_STORY_VS_GREEDY else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
