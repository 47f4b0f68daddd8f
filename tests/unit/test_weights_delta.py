"""Delta sync's encoding and rebuilding (services/weights/delta.py) without a transport, the
fingerprint of one tensor it checks with, and the rendezvous rule that picks the base. The real
broadcast is tests/integration/test_param_server_collective.py (gloo) and the GPU bench."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.errors import DataLoss, InvalidArgument
from services.param_server.rendezvous import RendezvousBoard
from services.weights.delta import BASE, IDX, SUM, VAL, DeltaDecoder, DeltaEncoder
from services.weights.layout import Fingerprinter, tensor_columns


def _model(version: int) -> dict[str, torch.Tensor]:
    """Version v: ~1% of each large tensor's elements moved per version (cumulative)."""
    g = torch.Generator().manual_seed(0)
    m = {"emb": torch.randn(300, 200, generator=g).bfloat16(), "mlp": torch.randn(120, 150, generator=g),
         "norm": torch.randn(16, generator=g).bfloat16(), "ids": torch.arange(20_000, dtype=torch.int64)}
    for k in range(1, version + 1):
        gk = torch.Generator().manual_seed(k)
        for name in ("emb", "mlp", "norm"):
            flat = m[name].view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=gk)
            flat[idx] = flat[idx] + float(k)
    return m


def _buckets(m: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
    return [[("emb", m["emb"]), ("norm", m["norm"])], [("mlp", m["mlp"]), ("ids", m["ids"])]]


def _send(enc: DeltaEncoder, version: int, agreed: int, split: bool = False) -> list[list[tuple[str, torch.Tensor]]]:
    async def base() -> int:
        return agreed

    async def run() -> list[list[tuple[str, torch.Tensor]]]:
        out = [b async for b in enc.encode(version, _buckets(_model(version)), base)]
        enc.commit(version)
        if split:  # one entry per bucket: a tensor's parts arrive in different buckets
            out = [[entry] for b in out for entry in b]
        return out

    return asyncio.run(run())


def _receive(dec: DeltaDecoder, version: int, wire: list[list[tuple[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    dec.begin(version)
    got = {}
    for bucket in wire:
        received = [(n, t.clone()) for n, t in bucket]  # the transport's receive buffer
        for name, t in dec.decode(received):
            got[name] = t.clone()
        for _, t in received:
            t.fill_(0)  # the slot is reused for the next bucket
    dec.commit()
    return got


def _same(got: dict[str, torch.Tensor], version: int) -> bool:
    want = _model(version)
    return set(got) == set(want) and all(got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in want.items())


@pytest.mark.parametrize("split", [False, True], ids=["bucketed", "parts in separate buckets"])
def test_versions_after_the_first_travel_as_changed_elements_and_rebuild_bit_for_bit(split: bool) -> None:
    enc, dec = DeltaEncoder(), DeltaDecoder()
    wire = _send(enc, 1, agreed=0, split=split)
    assert _same(_receive(dec, 1, wire), 1) and dec.version == 1
    assert enc.last.as_dict()["sent_fraction"] == 1.0
    for version in (2, 3):
        wire = _send(enc, version, agreed=dec.version, split=split)
        names = [n for b in wire for n, _ in b]
        assert {"emb" + IDX, "emb" + VAL, "emb" + SUM, "mlp" + IDX} <= set(names) and "emb" not in names
        assert "norm" in names and "ids" in names  # small, and not floating point: whole
        assert _same(_receive(dec, version, wire), version)
        stats = enc.last.as_dict()
        assert stats["base_version"] == version - 1 and stats["delta_tensors"] == 2
        assert 0.005 < stats["changed_fraction"] < 0.02  # ~1% moved, some twice or by less than an ulp
        whole = 160_000 + 32  # ids (not floating point) and norm (small) go whole every time
        assert stats["sent_bytes"] - whole < 0.1 * (stats["whole_bytes"] - whole)  # the two deltas
        assert dec.last.as_dict()["sent_bytes"] == stats["sent_bytes"]


def test_the_receivers_stats_show_a_version_only_once_it_is_committed() -> None:
    """The rollout's status reports `last` at any moment, also while a version loads: a version in
    progress must not show as the latest one with no base and half its bytes (the collective e2e
    read such a sample as "version 9 went whole")."""
    enc, dec = DeltaEncoder(), DeltaDecoder()
    _receive(dec, 1, _send(enc, 1, agreed=0))
    _receive(dec, 2, _send(enc, 2, agreed=1))
    done = dec.last.as_dict()
    assert done["version"] == 2 and done["base_version"] == 1 and done["delta_tensors"] == 2
    wire = _send(enc, 3, agreed=2)
    dec.begin(3)
    dec.decode([(n, t.clone()) for n, t in wire[0]])
    assert dec.last.as_dict() == done  # in progress: still version 2's numbers
    for bucket in wire[1:]:
        dec.decode([(n, t.clone()) for n, t in bucket])
    dec.commit()
    assert dec.last.version == 3 and dec.last.base_version == 2 and dec.last.sent_bytes == enc.last.sent_bytes
    dec.begin(4)
    dec.reset()  # a failed version: the last good one still shows
    assert dec.last.version == 3


def test_a_sender_whose_base_is_not_the_receivers_sends_whole_tensors() -> None:
    enc, dec = DeltaEncoder(), DeltaDecoder()
    _receive(dec, 1, _send(enc, 1, agreed=0))
    wire = _send(enc, 2, agreed=7)  # the receivers hold another version: whole
    assert enc.last.base_version == 0 and not any(n.endswith(IDX) for b in wire for n, _ in b)
    assert _same(_receive(dec, 2, wire), 2)
    enc.reset()  # a failed publish: the next goes whole even if the receivers agree
    _send(enc, 3, agreed=2)
    assert enc.last.base_version == 0


def test_a_drifted_copy_fails_the_version_and_the_next_whole_one_repairs_it() -> None:
    enc, dec = DeltaEncoder(), DeltaDecoder()
    _receive(dec, 1, _send(enc, 1, agreed=0))
    dec.mirror["emb"].view(-1)[7] += 3.0  # this receiver's copy no longer equals the sender's
    with pytest.raises(DataLoss, match="drifted"):
        _receive(dec, 2, _send(enc, 2, agreed=1))
    dec.reset()  # what the fetcher does when a version fails
    assert dec.version == 0
    assert _same(_receive(dec, 3, _send(enc, 3, agreed=dec.version)), 3)


def test_a_delta_against_a_base_this_receiver_does_not_hold_is_refused_before_anything_changes() -> None:
    enc, dec = DeltaEncoder(), DeltaDecoder()
    _receive(dec, 1, _send(enc, 1, agreed=0))
    before = {n: t.clone() for n, t in dec.mirror.items()}
    wire = _send(enc, 2, agreed=1)
    wire[0] = [(BASE, torch.tensor([5, 2]))] + [e for e in wire[0] if e[0] != BASE]
    dec.begin(2)
    with pytest.raises(DataLoss, match="holds version 1"):
        dec.decode(wire[0])
    assert all(torch.equal(before[n], t) for n, t in dec.mirror.items())


def test_a_version_without_its_base_entry_or_with_a_part_missing_is_data_loss() -> None:
    enc, dec = DeltaEncoder(), DeltaDecoder()
    _receive(dec, 1, _send(enc, 1, agreed=0))
    wire = _send(enc, 2, agreed=1)
    missing_part = [[e for e in b if e[0] != "mlp" + SUM] for b in wire]
    with pytest.raises(DataLoss, match="without all their parts"):
        _receive(dec, 2, missing_part)
    assert dec.version == 0
    with pytest.raises(DataLoss, match="does not use delta sync"):
        _receive(dec, 3, [[("norm", _model(3)["norm"])]])


@pytest.mark.parametrize("split", [False, True], ids=["bucketed", "parts in separate buckets"])
def test_the_bucket_with_the_base_entry_may_arrive_last(split: bool) -> None:
    """A transport resends a NACKed bucket after the ones behind it (collective receiver.py): when
    that is the bucket carrying #delta.base, the delta entries that came first wait for it and the
    version still rebuilds bit for bit; a version that never brings it is DataLoss."""
    enc, dec = DeltaEncoder(), DeltaDecoder()
    _receive(dec, 1, _send(enc, 1, agreed=0, split=split))
    wire = _send(enc, 2, agreed=1, split=split)
    first = next(i for i, b in enumerate(wire) if any(n == BASE for n, _ in b))
    resent = wire[:first] + wire[first + 1 :] + [wire[first]]
    assert any(n.endswith(IDX) for b in resent[:-1] for n, _ in b)  # deltas do come before the base
    assert _same(_receive(dec, 2, resent), 2) and dec.last.base_version == 1 and dec.last.delta_tensors == 2
    wire = _send(enc, 3, agreed=2, split=split)
    with pytest.raises(DataLoss, match=r"no '#delta\.base' entry"):
        _receive(dec, 3, [b for b in wire if not any(n == BASE for n, _ in b)])
    assert dec.version == 0


def test_a_version_begun_and_never_finished_leaves_no_base() -> None:
    enc, dec = DeltaEncoder(), DeltaDecoder()
    _receive(dec, 1, _send(enc, 1, agreed=0))
    dec.begin(2)
    dec.decode(_send(enc, 2, agreed=1)[0])  # half of version 2 lands in the copy, then nothing
    dec.begin(3)
    assert dec.version == 0


@pytest.mark.parametrize("nbytes", [1, 7, 8, 9, 4072, 4073, 65_537])
@pytest.mark.parametrize("offset", [0, 2, 6])
def test_tensor_columns_are_the_fingerprint_columns_of_the_tensors_bytes(nbytes: int, offset: int) -> None:
    g = torch.Generator().manual_seed(nbytes + offset)
    raw = torch.randint(0, 256, (offset + nbytes,), dtype=torch.uint8, generator=g)
    t = raw[offset:]
    fp = Fingerprinter(nbytes)
    fp.update(0, bytes(t.numpy()))
    assert torch.equal(tensor_columns(t), fp.columns())


def _board_with(bases: dict[str, int], world_size: int = 3) -> RendezvousBoard:
    board = RendezvousBoard()
    board.sender_check_in("g", "s", world_size=world_size, backend="gloo", master_address="127.0.0.1",
                          master_port=1234, policy_version=5)
    for member, base in bases.items():
        board.receiver_check_in("g", member, backend="gloo", world_size=world_size, policy_version=5,
                                delta_base_version=base)
    return board


def test_the_rendezvous_answers_the_base_only_when_every_receiver_holds_it() -> None:
    assert _board_with({"a": 4, "b": 4}).group("g").delta_base(5) == 4  # type: ignore[union-attr]
    assert _board_with({"a": 4, "b": 3}).group("g").delta_base(5) == 0  # type: ignore[union-attr]
    assert _board_with({"a": 4, "b": 0}).group("g").delta_base(5) == 0  # type: ignore[union-attr]
    assert _board_with({"a": 4}).group("g").delta_base(5) == 0  # type: ignore[union-attr]  # b not in yet
    board = _board_with({"a": 4, "b": 4})
    board.withdraw("g", "b", 5)
    assert board.group("g").delta_base(5) == 0  # type: ignore[union-attr]


def test_a_negative_base_is_refused_before_the_board_changes() -> None:
    board = _board_with({})
    with pytest.raises(InvalidArgument, match="delta_base_version"):
        board.receiver_check_in("g", "a", backend="gloo", world_size=3, policy_version=5, delta_base_version=-1)
    state = board.group("g")
    assert state is not None and not state.ranks and not state.checked_in


def test_a_sender_with_nothing_to_send_still_names_the_base_and_its_receivers_commit() -> None:
    """With param_server.collective_sharded a trainer rank may own nothing (a megatron replica
    sends nothing, shards.py): its version has no bucket. Without the base entry every receiver's
    commit raised DataLoss ("the sender does not use delta sync"): that part, hence the whole
    sharded version, failed on every receiver, every version."""
    enc, dec = DeltaEncoder(), DeltaDecoder()

    async def base() -> int:
        return 0

    async def run() -> list[list[tuple[str, torch.Tensor]]]:
        return [b async for b in enc.encode(1, [], base)]

    wire = asyncio.run(run())
    enc.commit(1)
    dec.begin(1)
    got = [entry for bucket in wire for entry in dec.decode(bucket)]
    dec.commit()
    assert got == [] and dec.version == 1


def test_the_in_process_digest_takes_a_0_dim_tensor() -> None:
    import hashlib

    from services.weights.in_process import tensor_digest

    a, b = hashlib.sha256(), hashlib.sha256()
    tensor_digest(a, "scale", torch.tensor(1.5))
    tensor_digest(b, "scale", torch.tensor(2.5))
    assert a.hexdigest() != b.hexdigest()
