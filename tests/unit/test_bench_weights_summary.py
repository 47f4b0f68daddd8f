"""`meshrl bench weights` bookkeeping: cold, warm-up and steady rounds kept apart, targets on the
steady rounds with the cold round beside them."""

from __future__ import annotations

from meshrl.bench.weights import GiB, _summary, _targets


def rounds(*publish: float) -> list[dict[str, float]]:
    return [{"publish": p, "fetch": 0.01, "end_to_end": p + 0.01} for p in publish]


def test_warmup_rounds_are_reported_on_their_own_and_left_out_of_the_steady_numbers() -> None:
    s = _summary(GiB, rounds(4.0, 2.0, 1.0, 0.5, 0.25), warmup=2)
    p = s["publish"]
    assert s["warmup_rounds"] == 2 and p["cold_s"] == 4.0 and p["warmup_s"] == [2.0, 1.0]
    assert p["best_s"] == 0.25 and p["median_s"] == 0.375 and p["cold_GBps"] == round(GiB / 4.0 / 1e9, 3)
    plain = _summary(GiB, rounds(4.0, 2.0, 1.0))  # no warm-up: rounds 1.. are steady, as before
    assert "warmup_s" not in plain["publish"] and plain["publish"]["median_s"] == 1.5


def test_targets_use_the_steady_rounds_and_print_the_cold_round_beside() -> None:
    r = {"baselines": {"memcpy": {"best_GBps": 12.0}, "memcpy_fresh": {"GBps": 3.0}},
         "transports": {"object_store": _summary(GiB, rounds(1.0, 0.5, 0.2, 0.19), warmup=1),
                        "grpc": _summary(GiB, rounds(2.0, 1.5, 0.9, 0.95), warmup=1)}}
    t = _targets(r)
    o = t["object_store_ge_50pct_memcpy"]
    assert o["end_to_end_GBps"]["best"] == round(GiB / 0.2 / 1e9, 3) and o["met"] is False  # 5.37 < 0.5 * 12
    assert o["cold_end_to_end_GBps"] == round(GiB / 1.01 / 1e9, 3) and o["ratio_cold"] < o["ratio_best"]
    assert o["memcpy_fresh_GBps"] == 3.0
    g = t["grpc_ge_1GBps"]
    assert g["met"] is True and g["cold_GBps"]["publish"] == round(GiB / 2.0 / 1e9, 3)


def test_the_paired_ratio_takes_each_round_against_the_memcpy_just_before_it() -> None:
    timed = [{"publish": p, "fetch": 0.01, "end_to_end": p + 0.01, "memcpy": m}
             for p, m in ((1.0, 0.1), (0.5, 0.1), (0.19, 0.1), (0.29, 0.2), (0.39, 0.1))]
    r = {"baselines": {"memcpy": {"best_GBps": GiB / 0.1 / 1e9}, "memcpy_fresh": {"GBps": 3.0}}, "warmup_rounds": 1,
         "transports": {"object_store": _summary(GiB, timed, warmup=1)}}
    o = _targets(r)["object_store_ge_50pct_memcpy"]
    # steady rounds 0.2 / 0.3 / 0.4 s end to end, each after its own memcpy: 0.5, 0.667, 0.25
    assert o["paired"] == {"ratio_median": 0.5, "ratio_best": 0.667, "ratio_worst": 0.25, "memcpy_ms": [100.0, 200.0],
                           "met": True}
    assert o["met"] is True and o["ratio_median"] == 0.333  # against the run's one baseline: 0.1 s / 0.3 s


def test_the_paired_memcpy_copies_every_byte_of_each_bucket() -> None:
    import torch

    from meshrl.bench.weights import PairedMemcpy, make_weights
    from services.weights.packing import pack_bucket

    tensors = make_weights(80 << 20, 64 << 20, layout="tensors")  # tensors of 32, 32, 16 MiB: buckets [32, 32], [16]
    packed = [pack_bucket(b) for b in tensors]
    for weights in (tensors, packed):
        paired = PairedMemcpy(weights, repeats=1)
        assert paired.scratch.numel() == 64 << 20 and paired()["memcpy"] > 0
        first = weights[0]
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in first])
        assert not torch.equal(paired.scratch[: flat.numel()], flat)  # the last bucket was copied over it
        last = weights[-1]
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in last])
        assert torch.equal(paired.scratch[: flat.numel()], flat)  # the last bucket's bytes, in order
