"""DLRover's peer of benchmarks/live_config.py: its ParalConfigTuner and ElasticDataLoader, unchanged, with a
stub in place of DLRover's master (which needs its own job master; not run here).

The tuner's thread reports the local config, sleeps 30 s, asks the master for the config and writes it to
the file ``DLROVER_PARAL_CONFIG_PATH``; a training loop calls ``ElasticDataLoader.update_batch_size()`` every
50 ms step, which reads that file. Each change is timed from the moment the stub master holds it to the step
whose loader has the new batch size. ``--site`` is a site-packages dir with dlrover (appended to sys.path, so
this interpreter's torch is used). The last line printed is the summary.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import threading
import time
from pathlib import Path

STEP_S = 0.05


class StubMaster:
    """What ParalConfigTuner asks of DLRover's MasterClient: report the local config, get the master's."""

    def __init__(self, config: object) -> None:
        self.config = config
        self.reports = 0

    def report_paral_config(self, config: object) -> None:
        self.reports += 1

    def get_paral_config(self) -> object:
        return self.config


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--changes", type=int, default=3)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--site", default="")
    args = parser.parse_args()
    if args.site:
        sys.path.append(args.site)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    os.environ["DLROVER_PARAL_CONFIG_PATH"] = str(Path(args.dir) / "paral_config.json")
    import torch
    from dlrover.python.common.comm import DataLoaderConfig, ParallelConfig
    from dlrover.python.elastic_agent.config.paral_config_tuner import MasterClient, ParalConfigTuner
    from dlrover.trainer.torch.elastic.dataloader import ElasticDataLoader

    stub = StubMaster(ParallelConfig())
    MasterClient._instance = stub  # what MasterClient.singleton_instance() hands out
    tuner = ParalConfigTuner()
    loader = ElasticDataLoader(torch.utils.data.TensorDataset(torch.arange(100_000)), batch_size=32,
                               config_file=tuner.config_path)
    tuner.start()
    seen: list[tuple[float, int]] = []
    stop = threading.Event()

    def train() -> None:  # the script's side: one update_batch_size() per step, as DLRover's trainer does
        size = loader.get_batch_size()
        while not stop.is_set():
            loader.update_batch_size()
            if loader.get_batch_size() != size:
                size = loader.get_batch_size()
                seen.append((time.time(), size))
            time.sleep(STEP_S)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    rng = random.Random(0)
    times = []
    for k in range(args.changes):
        time.sleep(rng.uniform(0.0, 3.0))
        batch = 40 + 8 * k
        began = time.time()
        stub.config = ParallelConfig(dataloader=DataLoaderConfig(version=k + 1, dataloader_name="bench",
                                                                 batch_size=batch))
        deadline = began + 45
        while time.time() < deadline and not any(size == batch for _, size in seen):
            time.sleep(0.01)
        done = next((t for t, size in seen if size == batch), None)
        took = None if done is None else done - began
        if took is not None:
            times.append(took)
        print(f"  DLRover change {k + 1}/{args.changes}: batch_size={batch}, "
              f"{'not applied in 45 s' if took is None else f'{took:.2f} s'}", flush=True)
    stop.set()
    ordered = sorted(times)
    p50 = ordered[max(0, math.ceil(0.5 * len(ordered)) - 1)] if ordered else None
    p95 = ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)] if ordered else None
    shown = "-" if p50 is None else f"p50 {p50:.2f} s, p95 {p95:.2f} s"
    print(f"DLRover ParalConfigTuner + ElasticDataLoader (run, stub master, update_batch_size() each 50 ms step): "
          f"{len(times)}/{args.changes} batch-size changes applied, {shown}; its tuner polls every 30 s "
          "(batch size only, no common step across ranks)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
