"""EpochPlan: repeats, per-epoch shuffles, data-parallel slices, single-bucket batches, empty buckets."""
from collections import Counter
from pathlib import Path

import pytest

from pipetrain.backend.data import EpochPlan, MediaItem, Example
from pipetrain.backend.errors import DatasetError

SQUARE, WIDE = (512, 512), (640, 400)


def examples(count: int, bucket=SQUARE, repeats: int = 1, prefix: str = "img") -> list[Example]:
    return [Example(MediaItem(Path(f"/data/{prefix}{i}.png"), "", 1, 1, repeats, (512,)), bucket)
            for i in range(count)]


def flatten(steps) -> list[Example]:
    return [example for step in steps for micro in step for example in micro]


def plans(data, *, micro=1, accum=1, world=1, seed=0, repeats=None) -> list[EpochPlan]:
    return [EpochPlan(data, repeats, micro, accum, rank, world, seed) for rank in range(world)]


def test_each_sample_appears_num_repeats_times_per_epoch():
    data = examples(2, repeats=3) + examples(1, repeats=1, prefix="once")
    [plan] = plans(data)

    counts = Counter(example.item.path.name for example in flatten(plan.epoch(0)))

    assert counts == {"img0.png": 3, "img1.png": 3, "once0.png": 1}
    assert plan.steps_per_epoch() == 7


def test_explicit_repeats_override_the_items():
    data = examples(2, repeats=3)
    [plan] = plans(data, repeats=[1, 4])

    counts = Counter(example.item.path.name for example in flatten(plan.epoch(0)))

    assert counts == {"img0.png": 1, "img1.png": 4}


def test_steps_have_grad_accum_micro_batches_of_micro_batch_size():
    [plan] = plans(examples(24), micro=2, accum=3)

    steps = plan.epoch(0)

    assert plan.steps_per_epoch() == len(steps) == 4
    assert [[len(micro) for micro in step] for step in steps] == [[2, 2, 2]] * 4


def test_order_differs_between_epochs_and_repeats_for_the_same_seed_and_epoch():
    data = examples(32)
    [plan] = plans(data, micro=2, seed=7)
    [same] = plans(data, micro=2, seed=7)
    [other_seed] = plans(data, micro=2, seed=8)

    assert plan.epoch(0) == same.epoch(0)
    assert plan.epoch(3) == same.epoch(3)
    assert plan.epoch(0) != plan.epoch(1)
    assert plan.epoch(0) != other_seed.epoch(0)
    assert sorted(flatten(plan.epoch(0)), key=str) == sorted(flatten(plan.epoch(1)), key=str) == sorted(data, key=str)


def test_data_parallel_ranks_get_disjoint_slices_that_cover_each_global_batch():
    data = examples(32) + examples(16, WIDE, prefix="wide")
    ranks = plans(data, micro=2, accum=2, world=2, seed=3)
    assert [plan.steps_per_epoch() for plan in ranks] == [6, 6]

    per_rank = [plan.epoch(1) for plan in ranks]

    for step_index in range(6):
        rank0 = flatten([per_rank[0][step_index]])
        rank1 = flatten([per_rank[1][step_index]])
        assert len(rank0) == len(rank1) == 4
        assert not set(rank0) & set(rank1)
        assert len({example.bucket for example in rank0 + rank1}) == 1  # both ranks train the same bucket
    assert sorted(flatten(per_rank[0]) + flatten(per_rank[1]), key=str) == sorted(data, key=str)


def test_every_micro_batch_holds_one_bucket():
    data = examples(9) + examples(7, WIDE, prefix="wide") + examples(5, (400, 640), prefix="tall")
    [plan] = plans(data, micro=3, seed=1)

    steps = plan.epoch(0)

    assert len(steps) == 3 + 2 + 1
    for step in steps:
        for micro in step:
            assert len({example.bucket for example in micro}) == 1
    assert Counter(step[0][0].bucket for step in steps) == {SQUARE: 3, WIDE: 2, (400, 640): 1}


def test_remainders_are_dropped_per_bucket():
    data = examples(10) + examples(3, WIDE, prefix="wide")
    [plan] = plans(data, micro=2, accum=2)

    assert plan.steps_per_epoch() == 2
    assert plan.dropped() == {SQUARE: 2, WIDE: 3}
    assert len(flatten(plan.epoch(0))) == 8


def test_warns_about_each_bucket_smaller_than_one_global_batch():
    data = examples(3) + examples(8, WIDE, prefix="wide") + examples(1, (400, 640), prefix="tall")
    [plan, _] = plans(data, micro=1, accum=2, world=2)

    warnings = plan.warnings()

    assert len(warnings) == 2
    assert warnings[0].startswith(
        "bucket 400x640 has 1 example, fewer than one global batch of 4: it is not trained; ")
    assert warnings[1].startswith(
        "bucket 512x512 has 3 examples, fewer than one global batch of 4: it is not trained; ")


def test_no_warnings_when_every_bucket_trains():
    [plan] = plans(examples(4) + examples(4, WIDE, prefix="wide"), micro=2, accum=2)

    assert plan.warnings() == []


def test_a_dataset_with_no_full_global_batch_is_an_error():
    data = examples(3, repeats=1) + examples(1, WIDE, repeats=2, prefix="wide")

    with pytest.raises(DatasetError) as raised:
        EpochPlan(data, None, 2, 1, 0, 2, 0)

    message = str(raised.value)
    assert "the dataset has 5 examples (after repeats) in 2 buckets (512x512: 3, 640x400: 2)" in message
    assert "the global batch size is 4 (micro batch 2 x gradient accumulation 1 x 2 data-parallel GPUs)" in message
    for advice in ("fewer GPUs", "micro_batch_size_per_gpu", "gradient_accumulation_steps", "num_repeats",
                   "fewer buckets"):
        assert advice in message


def test_an_empty_sample_list_is_an_error():
    with pytest.raises(DatasetError, match="the dataset has no examples"):
        EpochPlan([], None, 1, 1, 0, 1, 0)


@pytest.mark.parametrize("kwargs", [dict(dp_rank=2, dp_world=2), dict(micro_batch_size=0), dict(repeats=[1, 1])])
def test_programming_errors_are_value_errors(kwargs):
    arguments = dict(examples=examples(4), repeats=None, micro_batch_size=1, grad_accum_steps=1, dp_rank=0,
                     dp_world=1, seed=0) | kwargs
    with pytest.raises(ValueError):
        EpochPlan(**arguments)


def test_per_resolution_batches_follow_the_nearest_resolution_of_each_bucket(tmp_path):
    """diffusion-pipe's micro_batch_size_per_gpu = [[512, 4], [1024, 1]]: read into our *_by_resolution key (the
    first batch kept as the integer), and each bucket batches the entry nearest sqrt(width x height)."""
    from pipetrain.backend.config import RunConfig
    from pipetrain.backend.data.epoch_plan import EpochPlan, batches_by_resolution
    from pipetrain.backend.config.schema import from_dict

    cfg = from_dict(RunConfig, {"output_dir": str(tmp_path), "dataset": "d.toml",
                                "micro_batch_size_per_gpu": [[512, 4], [1024, 1]],
                                "model": {"type": "flux", "diffusion_model": "a", "vae": "b"}}, file=None)
    assert cfg.micro_batch_size_per_gpu == 4 and cfg.micro_batch_size_by_resolution == [[512, 4], [1024, 1]]
    by_res = batches_by_resolution(cfg)
    assert by_res == {"clip": [[512, 4], [1024, 1]], "image": [[512, 4], [1024, 1]]}
    small, large = examples(8, (512, 512), prefix="s"), examples(3, (1024, 1024), prefix="l")
    odd = examples(2, (832, 640), prefix="o")   # sqrt(832 x 640) = 730: nearer 512
    plan = EpochPlan(small + large + odd, None, cfg.micro_batch_size_per_gpu, 1, 0, 1, 0, by_resolution=by_res)
    assert [plan.micro_batch_size_of(b) for b in ((512, 512), (1024, 1024), (832, 640))] == [4, 1, 4]
    assert plan.steps_per_epoch() == 8 // 4 + 3 // 1 + 0        # the two 832x640 fill no batch of 4
    sizes = sorted(len(step[0]) for step in plan.epoch(1))
    assert sizes == [1, 1, 1, 4, 4]


@pytest.mark.parametrize("keys, expected", [
    # diffusion-pipe's eval lists: images take the image list, clips the eval one
    ({"eval_micro_batch_size_per_gpu": [[512, 2], [1024, 1]],
      "image_eval_micro_batch_size_per_gpu": [[512, 4], [1024, 2]]}, {(512, 512): 4, (1024, 1024): 2,
                                                                       (512, 512, 9): 2, (1024, 1024, 9): 1}),
    # no eval key: eval batches as training does, its list included (diffusion-pipe's default)
    ({"micro_batch_size_per_gpu": [[512, 3], [1024, 1]]}, {(512, 512): 3, (1024, 1024): 1, (512, 512, 9): 3}),
    # an eval integer overrides the training list; the eval image list still decides for images
    ({"micro_batch_size_per_gpu": [[512, 3], [1024, 1]], "eval_micro_batch_size_per_gpu": 2,
      "eval_image_micro_batch_size_per_gpu": [[512, 5]]}, {(512, 512): 5, (1024, 1024): 5, (512, 512, 9): 2,
                                                           (1024, 1024, 9): 2}),
])
def test_eval_batches_follow_diffusion_pipes_per_resolution_eval_lists(tmp_path, keys, expected):
    """The eval keys take the per-resolution list form too, and the eval plans (``build_eval_sets``) batch each
    bucket by them."""
    from types import SimpleNamespace

    from pipetrain.backend.config import RunConfig
    from pipetrain.backend.config.schema import from_dict
    from pipetrain.backend.train.eval import build_eval_sets

    cfg = from_dict(RunConfig, {"output_dir": str(tmp_path), "dataset": "d.toml", **keys,
                                "model": {"type": "wan", "diffusion_model": "a", "vae": "b"}}, file=None)
    entries = [SimpleNamespace(bucket=bucket, num_repeats=1, latent=f"{i}", text="t")
               for bucket in expected for i in range(20)]
    data = SimpleNamespace(eval_entries={"held_out": entries}, store=None)
    topology = SimpleNamespace(dp_rank=0, dp_world=1, is_main=False)
    (eval_set,) = build_eval_sets(cfg, SimpleNamespace(objective=lambda: None), data, topology, None)
    assert {bucket: eval_set.plan.micro_batch_size_of(bucket) for bucket in expected} == expected
    assert sorted(len(step[0]) for step in eval_set.plan.epoch(0)) == sorted(
        size for bucket, size in expected.items() for _ in range(20 // size))


def test_subsample_ratio_trains_int_of_the_share_of_each_epochs_global_batches_another_share_each_epoch():
    """diffusion-pipe's subsample_ratio: int(global batches x ratio) of the epoch's global batches (its float
    rounding: 100 x 0.29 is 28.999..., so 28); the kept ones are the first of each epoch's own shuffle."""
    data = examples(40)
    half = EpochPlan(data, None, 2, 1, 0, 1, seed=5, subsample_ratio=0.5)
    full = EpochPlan(data, None, 2, 1, 0, 1, seed=5)

    assert half.steps_per_epoch() == len(half.epoch(1)) == 10 and full.steps_per_epoch() == 20
    assert half.epoch(1) == full.epoch(1)[:10]   # the same shuffle, cut where diffusion-pipe cuts
    kept = [{e.item.path.name for e in flatten(half.epoch(epoch))} for epoch in (1, 2)]
    assert all(len(k) == 20 for k in kept) and kept[0] != kept[1]
    assert EpochPlan(examples(100), None, 1, 1, 0, 1, seed=0, subsample_ratio=0.29).steps_per_epoch() == 28
    # two data-parallel ranks split the same kept batches
    ranks = [EpochPlan(data, None, 1, 1, rank, 2, seed=5, subsample_ratio=0.5) for rank in range(2)]
    assert [r.steps_per_epoch() for r in ranks] == [10, 10]
    assert sorted(e.item.path.name for r in ranks for e in flatten(r.epoch(3))) == \
        sorted(e.item.path.name for e in flatten(EpochPlan(data, None, 2, 1, 0, 1, 5, subsample_ratio=0.5).epoch(3)))


def test_a_subsample_ratio_that_keeps_no_batch_is_an_error_naming_the_key():
    with pytest.raises(DatasetError, match=r"subsample_ratio = 0.1 keeps none of the epoch's 4 global batches"):
        EpochPlan(examples(4), None, 1, 1, 0, 1, seed=0, subsample_ratio=0.1)
