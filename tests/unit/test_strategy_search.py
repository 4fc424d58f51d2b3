"""The strategy search's pure parts: candidates and feasibility pruning, the successive halving's choice
on a synthetic cost table, the cost model's ordering, and the strategy file (checked against its model); pipelines in
test_strategy_pipeline.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from convoy.errors import ConfigError
from convoy.parallel.topology import Link
from convoy.strategy.candidates import Hardware, generate, kept, micro_batches, require_feasible
from convoy.strategy.memory import Activations, ModelFeatures, predict
from convoy.strategy.plan import Strategy, StrategyFile
from convoy.strategy.report import parse_bytes
from convoy.strategy.search import CommCosts, predict_time, successive_halving

MB = 1e6


def features(batch: int = 8, params_mb: float = 100, per_sample_mb: float = 50, bf16_factor: float = 3.0,
             ) -> ModelFeatures:
    acts = Activations(per_sample=per_sample_mb * MB, fixed=0.0, checkpointed_per_sample=per_sample_mb * MB / 10,
                       block_per_sample=per_sample_mb * MB / 10)
    blocks = (params_mb * MB / 10,) * 8
    return ModelFeatures(
        fingerprint="f", summary="test model", param_bytes=int(params_mb * MB), buffer_bytes=0,
        root_param_bytes=int(params_mb * MB - sum(blocks)), block_param_bytes=tuple(int(b) for b in blocks),
        module_bytes=(), fp32=acts, bf16=acts, traced_on="meta", activation_factor=1.0, optimizer_state_ratio=2.0,
        optimizer_step_ratio=0.25, sample_s=0.01, micro_step_s=0.005, bf16_time_factor=bf16_factor,
        checkpoint_time_factor=1.3, optimizer_s=0.05, batch=batch, has_blocks=True)


def test_micro_batches_halve_while_they_divide() -> None:
    assert micro_batches(8) == [8, 4, 2, 1]
    assert micro_batches(12) == [12, 6, 3]
    assert micro_batches(1) == [1]


def test_memory_model_shares_what_each_kind_shards() -> None:
    f = features(per_sample_mb=0)
    ddp, zero, fsdp = (predict(f, Strategy(kind, micro_batch=8), 4).peak for kind in ("ddp", "zero", "fsdp"))
    assert ddp == pytest.approx(100 * MB * (2 + 2 + 1))  # params, grads (buckets), Adam's state, gloo's copy
    assert zero < ddp and fsdp < zero
    assert predict(f, Strategy("local", micro_batch=8, sync_every=8), 4).peak == ddp  # averaging after the step
    acts = features(params_mb=0.001)
    whole = predict(acts, Strategy(micro_batch=8), 1).peak
    assert predict(acts, Strategy(micro_batch=4, accumulation=2), 1).peak == pytest.approx(whole / 2, rel=1e-3)
    assert predict(acts, Strategy(micro_batch=8, checkpointing=True), 1).peak == pytest.approx(whole / 5, rel=1e-3)


def test_only_gloo_copies_the_whole_gradient_the_hierarchical_allreduces_hold_less() -> None:
    f = features(per_sample_mb=0)  # the step's transient decides the peak
    step = {(kind, allreduce): predict(f, Strategy(kind, allreduce, micro_batch=8), 4, per_node=2).optimizer_step
            for kind in ("ddp", "zero") for allreduce in ("gloo", "leader", "reduce_scatter")}
    assert step["ddp", "gloo"] == step["zero", "gloo"] == pytest.approx(100 * MB)  # gloo's copy of the buckets
    assert step["ddp", "reduce_scatter"] == step["zero", "reduce_scatter"] == pytest.approx(50 * MB)  # shards of 2
    assert step["ddp", "leader"] == pytest.approx(25 * MB)  # in place: Adam's step on the whole model
    assert step["zero", "leader"] == pytest.approx(25 * MB / 4)  # ... on the rank's quarter


def test_each_way_of_running_a_micro_step_has_its_own_measured_activation_factor() -> None:
    from dataclasses import replace

    f = features(params_mb=0.001)
    plain, ckpt = Strategy(micro_batch=8), Strategy(micro_batch=8, checkpointing=True)
    base = {s: predict(f, s, 1).forward_backward for s in (plain, ckpt)}
    measured = replace(f, checkpoint_activation_factor=2.0, bf16_activation_factor=0.0)
    assert predict(measured, ckpt, 1).forward_backward == pytest.approx(2 * base[ckpt])
    assert predict(measured, plain, 1).forward_backward == pytest.approx(base[plain])  # its own: 1.0
    bf16 = Strategy(micro_batch=8, bf16=True)
    assert predict(measured, bf16, 1).forward_backward == pytest.approx(predict(f, bf16, 1).forward_backward)
    assert measured.activation_factor_for(True, True) == f.activation_factor  # not measured: float32's


def test_calibrated_fsdp_peak_is_its_measured_fixed_part_and_share_of_the_activations() -> None:
    from dataclasses import replace

    f = features(params_mb=40, per_sample_mb=10)
    plain, split = Strategy("fsdp", micro_batch=8), Strategy("fsdp", micro_batch=4, accumulation=2)
    traced = predict(f, plain, 4)
    assert traced.forward_backward == pytest.approx(80 * MB + 8 * MB + 2 * 4 * MB)  # acts, root, two blocks
    measured = replace(f, fsdp_fixed=20 * MB, fsdp_activation_share=0.5)
    assert predict(measured, plain, 4).static == traced.static
    assert predict(measured, plain, 4).forward_backward == pytest.approx(20 * MB + 0.5 * 80 * MB)
    # the first micro-batch's sharded gradients are kept while the second runs
    assert predict(measured, split, 4).forward_backward == pytest.approx(20 * MB + 0.5 * 40 * MB + 10 * MB)
    assert predict(measured, Strategy("ddp", micro_batch=8), 4) == predict(f, Strategy("ddp", micro_batch=8), 4)
    assert ModelFeatures.from_dict(measured.to_dict()) == measured


def test_only_sensible_combinations() -> None:
    rows = generate(features(), Hardware(2, 2, 10e9, 8))
    strategies = [c.strategy for c in rows]
    assert not any(s.kind == "fsdp" and s.allreduce != "gloo" for s in strategies)
    assert {s.allreduce for s in strategies if s.kind == "ddp"} == {"gloo", "leader", "reduce_scatter"}
    assert {s.threads for s in strategies} == {1, 2, 4}  # 8 cores over 2 ranks of a node
    assert {(s.allreduce, s.sync_every) for s in strategies if s.kind == "local"} == {("gloo", 8)}
    assert all(s.sync_every == 1 for s in strategies if s.kind != "local")
    one_node = generate(features(), Hardware(1, 4, 10e9, 2))
    assert {c.strategy.allreduce for c in one_node} == {"gloo"}
    assert "local" not in {c.strategy.kind for c in one_node}  # no slow links between nodes to save
    assert {c.strategy.threads for c in one_node} == {1}
    with_room = kept(rows)
    assert not any(s.strategy.checkpointing for s in with_room)  # everything fits without: no reason to recompute
    assert not any(s.strategy.bf16 for s in with_room)  # bf16 measured 3x slower
    assert all(c.dropped.startswith("bf16 ran 3.0x slower") for c in rows if c.strategy.bf16
               and not c.strategy.checkpointing and c.strategy.micro_batch >= 4)


def test_feasibility_drops_what_does_not_fit_and_keeps_checkpointing_that_helps() -> None:
    f = features()
    limit = 780 * MB  # ddp's static part is 400 MB; 8 samples of activations (400 MB) do not fit on top
    rows = generate(f, Hardware(1, 4, limit, 2))
    for c in rows:
        if c.memory.peak > limit:
            assert c.dropped.startswith("over the limit: needs"), c
    feasible = [c.strategy for c in kept(rows)]
    assert feasible and all(predict(f, s, 4).peak <= limit for s in feasible)
    assert Strategy("ddp", micro_batch=8) not in feasible
    assert Strategy("ddp", checkpointing=True, micro_batch=8) in feasible  # fits only with recomputation
    assert Strategy("ddp", micro_batch=4, accumulation=2) in feasible
    near = {c.strategy: c for c in generate(f, Hardware(1, 4, 820 * MB, 2))}  # 800 MB is within 5% of 820
    assert near[Strategy("ddp", micro_batch=8)].memory.peak == pytest.approx(800 * MB)
    dropped = near[Strategy("ddp", micro_batch=8)].dropped
    assert dropped == "over the limit: needs 800 MB of the 779 MB usable (95% of it)", dropped


def test_a_limit_nothing_fits_names_the_smallest_need() -> None:
    f = features()
    hardware = Hardware(1, 4, 50 * MB, 2)
    rows = generate(f, hardware)
    assert not kept(rows)
    with pytest.raises(ConfigError, match=r"no candidate fits 50 MB per rank: the smallest need is (\d+) MB "
                                          r"\(fsdp ckpt mb1x8 t1\)"):
        require_feasible(rows, f, hardware)


def test_cost_model_prefers_the_hierarchical_allreduce_on_a_slow_link() -> None:
    f = features()
    hardware = Hardware(2, 2, 10e9, 8)
    slow_flat = CommCosts({"gloo": Link(1e-3, 1e-8), "leader": Link(1e-3, 4e-9), "reduce_scatter": Link(1e-3, 6e-9)})
    times = {a: predict_time(f, Strategy("ddp", a, micro_batch=8), hardware, slow_flat)
             for a in ("gloo", "leader", "reduce_scatter")}
    assert times["leader"] < times["reduce_scatter"] < times["gloo"]
    assert predict_time(f, Strategy(micro_batch=8, checkpointing=True), hardware, slow_flat) > times["gloo"]


def test_fsdp_pays_its_timed_collectives_once_a_micro_step_or_four_allreduces_where_untimed() -> None:
    f = features()
    hardware = Hardware(1, 4, 10e9, 2)
    line = CommCosts({"gloo": Link(1e-3, 1e-9)})
    timed = CommCosts(line.lines, fsdp_pass_s=0.5)
    plain, split = Strategy("fsdp", micro_batch=8), Strategy("fsdp", micro_batch=4, accumulation=2)
    assert predict_time(f, split, hardware, timed) - predict_time(f, plain, hardware, timed) == pytest.approx(
        0.5 + predict_time(f, split, hardware, CommCosts(line.lines, 0.0))
        - predict_time(f, plain, hardware, CommCosts(line.lines, 0.0)))
    units = len(f.block_param_bytes) + 1
    untimed = predict_time(f, plain, hardware, line) - predict_time(f, plain, hardware, CommCosts(line.lines, 0.0))
    assert untimed == pytest.approx(4 * (3 * units * 1e-3 + f.param_bytes * 1e-9))
    assert CommCosts.from_dict(timed.to_dict()) == timed and CommCosts.from_dict(line.to_dict()) == line


def test_successive_halving_picks_the_fastest_of_the_top_few() -> None:
    table = {"a": 1.0, "b": 0.7, "c": 0.9, "d": 0.5, "e": 0.1}  # the cost model ranked them a, b, c, d, e
    calls: list[tuple[str, int]] = []

    def measure(name: str, steps: int) -> list[float]:
        calls.append((name, steps))
        return [table[name] + 0.05 * (len(calls) <= 4)] * steps  # the first round's steps: noisier, higher

    winner, rounds = successive_halving(list(table), measure, keep=4, first_steps=2)
    assert winner == "d"  # the best of the four measured; e was ranked out by the model
    assert [len(r) for r in rounds] == [4, 2]
    assert calls[:4] == [("a", 2), ("b", 2), ("c", 2), ("d", 2)]
    assert sorted(calls[4:]) == [("b", 2), ("d", 2)]  # each survivor's 2 more steps: 4 in all
    assert [(m.steps, round(m.seconds, 3)) for m in rounds[1]] == [(4, 0.525), (4, 0.725)]  # all 4 steps' median
    assert "e" not in {name for name, _ in calls}
    assert successive_halving(["x"], lambda n, s: [1.0] * s)[0] == "x"


def test_successive_halving_stops_where_one_is_far_ahead_after_the_first_round() -> None:
    close = {c: 1.0 + 0.01 * i for i, c in enumerate("abcdefgh")}
    _, rounds = successive_halving(list(close), lambda n, s: [close[n]] * s, keep=8)
    assert [len(r) for r in rounds] == [8, 4, 2]  # 1% apart: down to the last two
    far = {**close, "c": 0.8}  # 20% ahead of the next
    winner, rounds = successive_halving(list(far), lambda n, s: [far[n]] * s, keep=8)
    assert winner == "c" and [len(r) for r in rounds] == [8, 4]  # not on one round's figure: it is confirmed
    _, rounds = successive_halving(list(far), lambda n, s: [far[n]] * s, keep=8, decisive=0.5)
    assert [len(r) for r in rounds] == [8, 4, 2]


def test_fsdp_is_calibrated_only_where_an_fsdp_candidate_could_be_measured() -> None:
    from convoy.strategy.worker import fsdp_contends

    rows = generate(features(), Hardware(1, 4, 10e9, 2))
    assert {c.strategy.kind for c in kept(rows)} >= {"ddp", "zero", "fsdp"}
    assert fsdp_contends(rows, lambda s: 0.5 if s.kind == "fsdp" else 1.0, 4)
    assert not fsdp_contends(rows, lambda s: 2.0 if s.kind == "fsdp" else 1.0, 4)
    few = [c for c in rows if c.strategy.kind == "fsdp" or c.strategy == Strategy("ddp", micro_batch=8)]
    assert fsdp_contends(few, lambda s: 2.0 if s.kind == "fsdp" else 1.0, 4)  # fewer than 4 others fit
    assert not fsdp_contends([c for c in rows if c.strategy.kind != "fsdp"], lambda s: 1.0, 4)  # no FSDP at all


def test_cost_model_prefers_local_sgd_where_the_link_between_nodes_is_very_slow() -> None:
    f = features()
    hardware = Hardware(2, 2, 10e9, 8)
    costs = CommCosts({"gloo": Link(1e-3, 1e-7), "leader": Link(1e-3, 5e-8), "node": Link(1e-4, 1e-9)})
    local = Strategy("local", micro_batch=8, sync_every=8)
    times = {s.name(): predict_time(f, s, hardware, costs) for s in (local, Strategy("ddp", "leader", micro_batch=8),
                                                                    Strategy(micro_batch=8))}
    assert times["local H8 mb8x1 t1"] < times["ddp/leader mb8x1 t1"] < times["ddp mb8x1 t1"]
    # each step: the node's allreduce; every 8th: all ranks'
    compute = (f.micro_step_s + f.sample_s * 8 + f.optimizer_s) / 1
    params = f.param_bytes
    buckets = -(-params // (25 * 2 ** 20))
    assert times["local H8 mb8x1 t1"] == pytest.approx(compute + buckets * 1e-4 + params * 1e-9
                                                        + (1e-3 + params * 1e-7) / 8)


def test_local_sgd_strategy_is_checked_and_named() -> None:
    assert Strategy("local", micro_batch=4, accumulation=2, sync_every=16).validate().name() == "local H16 mb4x2 t1"
    with pytest.raises(ConfigError, match="kind local needs sync_every >= 2"):
        Strategy("local").validate()
    with pytest.raises(ConfigError, match="sync_every 8 is for kind local only"):
        Strategy("ddp", sync_every=8).validate()
    with pytest.raises(ConfigError, match="allreduce 'leader' needs kind ddp or zero"):
        Strategy("local", "leader", sync_every=8).validate()


def test_strategy_file_round_trip_and_another_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    chosen = Strategy("fsdp", checkpointing=True, micro_batch=2, accumulation=4)
    StrategyFile(chosen, "abc123", "Net of 1.00 M parameters", 4, 8).save(path)
    loaded = StrategyFile.load(path)
    assert loaded.strategy == chosen and loaded.world_size == 4
    loaded.check_model("abc123", "Net of 1.00 M parameters", path)
    with pytest.raises(ConfigError, match=r"planned for another model \(Net of 1.00 M parameters, fingerprint "
                                          r"abc123\); this model is Other of 2.00 M parameters \(fingerprint zzz\)"):
        loaded.check_model("zzz", "Other of 2.00 M parameters", path)
    path.write_text('{"format": 1, "strategy": {"kind": "tp"}, "model": "a", "model_summary": "b", '
                    '"world_size": 1, "batch": 1}')
    with pytest.raises(ConfigError, match="strategy kind 'tp' is not one of ddp, zero, fsdp"):
        StrategyFile.load(path)
    with pytest.raises(ConfigError, match="allreduce 'leader' needs kind ddp or zero"):
        Strategy("fsdp", "leader").validate()


def test_memory_sizes_parse() -> None:
    assert parse_bytes("1.5GB") == 1.5e9
    assert parse_bytes("512MiB") == 512 * 2 ** 20
    with pytest.raises(ConfigError, match="is not a size"):
        parse_bytes("lots")


def test_the_cli_defaults_are_the_search_defaults() -> None:
    from convoy.strategy import cli, dryrun, search

    assert (cli.KEEP, cli.FIRST_STEPS) == (search.KEEP, search.FIRST_STEPS)
    defaults = dryrun.run_search.__kwdefaults__
    assert (defaults["keep"], defaults["first_steps"]) == (search.KEEP, search.FIRST_STEPS)

