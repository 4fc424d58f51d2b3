"""The sequence strategy's pure parts: its checks, memory and cost model, which degrees are candidates, and the
trace that finds ``convoy.attention`` in a model (the cut itself runs on gloo ranks in strategy_accelerate.py)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from convoy.errors import ConfigError
from convoy.parallel.topology import Link
from convoy.strategy.candidates import Hardware, generate, kept
from convoy.strategy.memory import ModelFeatures, Sequence, predict
from convoy.strategy.plan import Strategy
from convoy.strategy.search import CommCosts, predict_time
from convoy.strategy.workload import Workload
from test_strategy_search import MB, features

def with_sequence(f: ModelFeatures, length: int = 512, share: float = 0.2) -> ModelFeatures:
    return replace(f, sequence=Sequence(length=length, calls=4, causal=True, query_bytes_per_sample=1 * MB,
                                        attention_share=share))


def test_sequence_strategy_is_checked_and_named() -> None:
    s = Strategy("sequence", bf16=True, micro_batch=4, accumulation=2, sequence=2).validate()
    assert s.name() == "sequence s2 bf16 mb4x2 t1" and s.batch == 8
    assert Strategy.from_dict(s.to_dict()) == s
    with pytest.raises(ConfigError, match="kind sequence needs sequence >= 2 ranks a sample"):
        Strategy("sequence").validate()
    with pytest.raises(ConfigError, match="kind sequence takes no checkpointing"):
        Strategy("sequence", checkpointing=True, sequence=2).validate()
    with pytest.raises(ConfigError, match="sequence 2 is for kind sequence only"):
        Strategy("ddp", sequence=2).validate()
    with pytest.raises(ConfigError, match="allreduce 'leader' needs kind ddp or zero"):
        Strategy("sequence", allreduce="leader", sequence=2).validate()


def test_sequence_memory_is_a_share_of_the_positions_and_the_queries_kept_for_others() -> None:
    f = with_sequence(features(params_mb=10, per_sample_mb=40))
    ddp = predict(f, Strategy("ddp", micro_batch=4, accumulation=2), 2)
    cut = predict(f, Strategy("sequence", micro_batch=4, accumulation=2, sequence=2), 2)
    assert cut.static == ddp.static  # every rank holds the whole model, as under DDP
    # 4 samples' halves (80 MB of the 160 MB) and the other rank's queries of 4 samples (2 MB)
    assert ddp.forward_backward == pytest.approx(160 * MB) and cut.forward_backward == pytest.approx(82 * MB)
    bf16 = predict(f, Strategy("sequence", bf16=True, micro_batch=4, accumulation=2, sequence=2), 2)
    assert bf16.forward_backward == pytest.approx(86 * MB)  # attention in float32: 2 more of its 2 MB of queries
    assert ModelFeatures.from_dict(f.to_dict()) == f


def test_sequences_are_candidates_within_a_node_where_parts_are_long_enough() -> None:
    from convoy.strategy.candidates import sequences

    assert sequences(with_sequence(features()), Hardware(2, 4, 10e9, 4)) == [2, 4]
    assert sequences(with_sequence(features(), length=384), Hardware(1, 4, 10e9, 4)) == [2]  # 96 positions a part
    assert sequences(with_sequence(features(), length=32), Hardware(1, 4, 10e9, 4)) == []
    assert sequences(features(), Hardware(1, 4, 10e9, 4)) == []  # no attention through convoy's hooks
    rows = generate(with_sequence(features(per_sample_mb=5)), Hardware(1, 2, 10e9, 2))
    cuts = [c.strategy for c in kept(rows) if c.strategy.kind == "sequence"]
    assert {(s.sequence, s.bf16, s.micro_batch) for s in cuts} == {(2, False, 8), (2, False, 4)}  # bf16 3x slower
    assert not any(s.checkpointing for s in cuts)


def test_cost_model_charges_a_sequence_cut_its_causal_imbalance_and_messages() -> None:
    fast = CommCosts({"gloo": Link(0.0, 0.0)})
    hardware = Hardware(1, 2, 10e9, 2)
    ddp = predict_time(with_sequence(features()), Strategy("ddp", micro_batch=8), hardware, fast)
    cut = Strategy("sequence", micro_batch=8, sequence=2)
    # half the attention work a rank more (the last part's rank: 3/2 of DDP's) and one more micro-step's fixed time
    extra = 0.01 * 8 * 0.2 * 0.5 + 0.005
    assert predict_time(with_sequence(features()), cut, hardware, fast) == pytest.approx(ddp + extra)
    slow = CommCosts({"gloo": Link(1e-3, 1e-9)})
    latencies = 2 * 4 * 4 * 1e-3  # 4 messages a call, 4 calls, 2 micro-batches
    assert predict_time(with_sequence(features()), cut, hardware, slow) > predict_time(
        with_sequence(features()), cut, hardware, fast) + latencies


def test_the_sequence_trace_sees_convoy_attention_over_the_inputs_positions() -> None:
    from convoy.strategy.features import trace_sequence
    from convoy.strategy.workload import load_workload

    argv = sys.argv
    try:
        sys.argv = ["x", "--width", "32", "--layers", "2", "--heads", "2", "--vocab", "64", "--context", "16"]
        workload = load_workload(Path(__file__).resolve().parents[2] / "examples" / "train_strategy.py")
    finally:
        sys.argv = argv
    found = trace_sequence(workload)
    assert (found.length, found.calls, found.causal) == (16, 2, True)
    assert found.query_bytes_per_sample == 2 * 16 * 32 * 4 and 0 < found.attention_share < 0.5
    assert trace_sequence(workload, real=True) == found
    plain = Workload(model=lambda: torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64)),
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch=workload.batch, loss=workload.loss,
                     batch_size=4)
    assert trace_sequence(plain).length == 0  # no convoy.attention: no sequence cut
