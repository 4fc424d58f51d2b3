"""The strategy search's pipelines (pure): a model cut into contiguous stages by its layers, the strategy checked and
named, each rank's memory walked action by action, pipelines among the candidates, and their cost."""

from __future__ import annotations

import pytest

from convoy.errors import ConfigError
from convoy.parallel.topology import Link
from convoy.strategy.candidates import Hardware, generate
from convoy.strategy.memory import _rank_estimates, ModelFeatures, predict
from convoy.strategy.plan import Strategy
from convoy.strategy.search import CommCosts, predict_time
from test_strategy_search import MB, features


def with_layers(f: ModelFeatures, count: int = 10) -> ModelFeatures:
    """``f`` cut into ``count`` equal layers (its parameters and activations), each sending 1 MB a sample."""
    from dataclasses import replace

    from convoy.strategy.memory import Layer

    layer = Layer(param_bytes=f.param_bytes // count, weight=1.0, saved_per_sample=f.fp32.per_sample / count,
                  bf16_saved_per_sample=f.bf16.per_sample / count, out_per_sample=1 * MB)
    return replace(f, layers=(layer,) * count)


def test_balanced_bounds_cut_contiguous_pieces_with_the_lightest_heaviest() -> None:
    from convoy.parallel import balanced_bounds

    assert balanced_bounds([0, 5, 5, 5, 5, 7], 3) == [(0, 3), (3, 5), (5, 6)]  # heaviest 10; by count 12
    assert balanced_bounds([1, 1, 1, 1], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert balanced_bounds([3, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    with pytest.raises(ValueError, match="cannot cut 2 items into 3"):
        balanced_bounds([1, 1], 3)


def test_pipeline_strategy_is_checked_and_named() -> None:
    s = Strategy("pipeline", bf16=True, micro_batch=2, accumulation=4, stages=4, schedule="1f1b").validate()
    assert s.name() == "pipeline p4/1f1b bf16 mb2x4 t1" and s.batch == 8
    with pytest.raises(ConfigError, match="kind pipeline needs stages >= 2 and a schedule of 1f1b, interleaved"):
        Strategy("pipeline", stages=2, schedule="zigzag").validate()
    with pytest.raises(ConfigError, match="kind pipeline takes no checkpointing"):
        Strategy("pipeline", checkpointing=True, stages=2, schedule="1f1b").validate()
    with pytest.raises(ConfigError, match="stages 2 and schedule '' are for kind pipeline only"):
        Strategy("ddp", stages=2).validate()
    assert Strategy.from_dict(s.to_dict()) == s


def test_pipeline_memory_holds_a_stage_share_and_the_schedule_micro_batches_in_flight() -> None:
    f = with_layers(features(params_mb=100, per_sample_mb=10))
    one = Strategy("pipeline", micro_batch=1, accumulation=8, stages=2, schedule="1f1b")
    alone = predict(f, one, 2)
    assert alone.static == pytest.approx(50 * MB * (2 + 2))  # half the layers: parameters, gradients, Adam's state
    # 1F1B's first rank has at most 2 micro-batches in flight (5 MB saved, 1 MB sent and kept, 1 MB of its gradient
    # received each), and a layer's backward holds 0.4 of what the layer saved (1 MB) beside them; GPipe all 16
    assert alone.forward_backward == pytest.approx(2 * 7 * MB + 0.4 * MB)
    gpipe = predict(f, Strategy("pipeline", micro_batch=1, accumulation=8, stages=2, schedule="gpipe"), 2)
    assert gpipe.forward_backward == pytest.approx(16 * 7 * MB + 0.4 * MB)
    assert predict(f, one, 4).optimizer_step == pytest.approx(50 * MB)  # two pipelines: the flat gradients
    assert predict(f, one, 2).peak < predict(f, Strategy("ddp", micro_batch=1, accumulation=8), 2).peak
    assert ModelFeatures.from_dict(f.to_dict()) == f


def test_the_last_stage_holds_the_loss_backward_beside_its_micro_batch_and_no_rank_a_measured_factor() -> None:
    from dataclasses import replace

    from convoy.strategy.memory import BACKWARD_TRANSIENT, LOSS_TRANSIENT

    f = with_layers(features(per_sample_mb=10))
    one = Strategy("pipeline", micro_batch=2, accumulation=4, stages=2, schedule="1f1b")
    first, last = _rank_estimates(f, one, 2)
    assert first.forward_backward == pytest.approx(2 * 2 * 7 * MB + BACKWARD_TRANSIENT * 2 * MB)
    # one micro-batch in flight (what its layers saved: it sends nothing), and the loss's backward: 2 samples' logits
    # (the last layer's output, 1 MB a sample) twice
    assert last.forward_backward == pytest.approx(2 * 5 * MB + LOSS_TRANSIENT * 2 * MB)
    assert LOSS_TRANSIENT == 2.0
    # a whole micro-step's factor is the loss's: a stage's activations are the traced ones
    assert _rank_estimates(replace(f, activation_factor=1.6), one, 2) == [first, last]


def test_an_embedding_tables_gradient_comes_last_in_its_stages_backward_when_the_blocks_saved_bytes_are_freed(
        ) -> None:
    from dataclasses import replace

    from convoy.strategy.memory import BACKWARD_TRANSIENT, Layer

    f = with_layers(features(per_sample_mb=10))
    table = Layer(param_bytes=int(8 * MB), weight=1.0, saved_per_sample=0.0, bf16_saved_per_sample=0.0,
                  out_per_sample=1 * MB, largest_param_bytes=int(8 * MB))
    block = replace(f.layers[0], largest_param_bytes=int(1 * MB))
    f = replace(f, layers=(table, block, block, block))  # stages: the table and a block, then two blocks
    first, _ = _rank_estimates(f, Strategy("pipeline", micro_batch=2, accumulation=4, stages=2, schedule="1f1b"), 2)
    in_flight = 2 * 2 * (1 + 2 * 1) * MB  # 2 micro-batches of 2 samples: a block's 1 MB saved, 2 MB sent
    # the block's backward (0.4 of its 2 MB, and its 1 MB gradient) or, once the block's 2 MB are freed, the table's
    # 8 MB gradient: never both
    backward = max(BACKWARD_TRANSIENT * 2 * MB + 1 * MB, 8 * MB - 2 * MB)
    assert first.forward_backward == pytest.approx(in_flight + backward)


def test_pipelines_are_candidates_where_the_layers_allow_and_interleaving_where_it_pays() -> None:
    f = with_layers(features(), count=6)
    rows = generate(f, Hardware(1, 4, 10e9, 2))
    shapes = {(c.strategy.stages, c.strategy.schedule) for c in rows if c.strategy.kind == "pipeline"}
    assert shapes == {(2, "1f1b"), (2, "interleaved"), (4, "1f1b")}  # 4 x 2 stages need 8 layers
    assert not any(c.strategy.checkpointing for c in rows if c.strategy.kind == "pipeline")
    assert "pipeline" not in {c.strategy.kind for c in generate(features(), Hardware(1, 4, 10e9, 2))}  # no layers

    inter = Strategy("pipeline", micro_batch=8, stages=2, schedule="interleaved")
    for gain, reason in ((0.99, "interleaved not predicted 3% faster than 1f1b: 0.990 s against 1.000 s"), (0.9, "")):
        found = {c.strategy: c for c in generate(f, Hardware(1, 4, 10e9, 2),
                                                 lambda s, g=gain: g if s.schedule == "interleaved" else 1.0)}
        assert found[inter].dropped == reason, found[inter]


def test_cost_model_gives_a_pipeline_no_gradient_allreduce() -> None:
    f = with_layers(features())
    slow = CommCosts({"gloo": Link(1e-3, 1e-6)})  # 1 MB/s: DDP's 100 MB allreduce takes 100 s
    pipe = Strategy("pipeline", micro_batch=1, accumulation=8, stages=4, schedule="1f1b")
    hardware = Hardware(1, 4, 10e9, 4)
    ddp = predict_time(f, Strategy("ddp", micro_batch=8), hardware, slow)
    assert predict_time(f, pipe, hardware, slow) < ddp / 3  # only activations (1 MB a sample) cross the link
    # two pipelines of two allreduce half the gradients each, 50 s on top of their messages
    two = Strategy("pipeline", micro_batch=1, accumulation=8, stages=2, schedule="1f1b")
    assert 50 < predict_time(f, two, hardware, slow) < ddp


def test_a_model_is_pipelined_by_its_layers_in_order_and_never_with_tied_weights() -> None:
    from torch import nn

    from convoy.strategy.pipelined import layer_weight, layers_of, shared_parameter

    seq = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
    assert layers_of(seq) == list(seq.children())
    assert layer_weight(seq[0]) == 1.0 and layer_weight(seq[1]) == 21.0  # a table's rows are looked up, not computed
    assert layers_of(nn.Linear(2, 2)) is None

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

        def pipeline_layers(self) -> list[nn.Module]:
            return [self.embed, self.head]

    assert shared_parameter(layers_of(Tied())) == "layers 0 and 1 share parameter weight"

    class Empty(nn.Module):
        def pipeline_layers(self) -> list[nn.Module]:
            return []

    with pytest.raises(ConfigError, match=r"Empty.pipeline_layers\(\) must return a non-empty list"):
        layers_of(Empty())
