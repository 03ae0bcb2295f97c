"""Sharded checkpoints: format, atomic saves, reads per rank, bad input, offline reshard, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from zerosim.checkpoint import (
    INDEX_NAME,
    inspect_checkpoint,
    load_engine_state,
    read_index,
    reshard,
    save_engine_state,
)
from zerosim.checkpoint.engine_state import engine_snapshot
from zerosim.checkpoint.format import CheckpointReader
from zerosim.checks.checkpoint import check_checkpoint_equivalence
from zerosim.cli import main
from zerosim.engine.config import RunConfig
from zerosim.errors import ConfigError
from zerosim.numerics.model import SimModelConfig
from zerosim.testing.checkpoint_runs import load_and_snapshot, run_engines, train_and_save

BLOCK = 4096


def cfg(strategy="zero3", world=4, **kw):
    return RunConfig(strategy=strategy, world_size=world, steps=4, observe="none", **kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A zero3 checkpoint of 4 ranks after 2 steps, and rank 0's snapshot of what was saved."""
    d = tmp_path_factory.mktemp("zero3-4")
    snaps = train_and_save(cfg(), 2, d, block_bytes=BLOCK)
    return d, snaps[0]


@pytest.fixture
def copy(ckpt, tmp_path):
    """A private copy of the checkpoint a test may damage."""
    import shutil

    d = tmp_path / "ck"
    shutil.copytree(ckpt[0], d)
    return d


def edit_index(d, fn):
    p = d / INDEX_NAME
    data = json.loads(p.read_text())
    fn(data)
    p.write_text(json.dumps(data))


# ---- format --------------------------------------------------------------------------------------


def test_one_file_per_writing_rank_and_one_index_covering_every_element(ckpt):
    d, snap = ckpt
    ix = read_index(d)
    assert [f.rank for f in ix.files] == [0, 1, 2, 3] and ix.step == 2
    assert ix.states == ("master", "exp_avg", "exp_avg_sq") and ix.world_size == 4
    assert sorted(p.name for p in d.iterdir()) == sorted([INDEX_NAME] + [f.name for f in ix.files])
    owned = sum(b - a for f in ix.files for a, b in f.ranges)
    assert owned == ix.total_numel == snap.states["master"].shape[0]  # padding never written
    assert inspect_checkpoint(d).ok


def test_shard_files_are_plain_safetensors(ckpt):
    st = pytest.importorskip("safetensors.numpy")
    d, snap = ckpt
    for f in read_index(d).files:
        tensors = st.load_file(str(d / f.name))
        for key, arr in tensors.items():
            state, rng = key.split("/")
            a, b = map(int, rng.split(":"))
            assert np.array_equal(arr, snap.states[state][a:b])


def test_hybrid_replicas_write_one_copy(tmp_path):
    train_and_save(cfg("hybrid_shard:2", 4), 1, tmp_path, block_bytes=BLOCK)
    ix = read_index(tmp_path)
    assert [f.rank for f in ix.files] == [0, 1] and ix.shard_group_size == 2


# ---- atomicity -----------------------------------------------------------------------------------


def test_a_save_killed_before_its_index_leaves_the_previous_checkpoint_loadable(tmp_path):
    run = cfg("zero2", 2).resolve()
    first = train_and_save(run, 1, tmp_path, block_bytes=BLOCK)[0]
    old = read_index(tmp_path)

    class Killed(Exception):
        pass

    def body(engine, schedule):
        schedule.step(0)
        schedule.step(1)

        def die():
            raise Killed("the process died between the shard files and the index")

        save_engine_state(engine, tmp_path, block_bytes=BLOCK, before_index=die)

    with pytest.raises(Exception, match="died between"):
        run_engines(run, body)
    names = {p.name for p in tmp_path.iterdir()}
    assert {f.name for f in old.files} <= names and len(names) > len(
        old.files
    ) + 1  # new shards, no new index
    assert read_index(tmp_path).save_id == old.save_id
    assert inspect_checkpoint(tmp_path).ok  # every file of the old index verifies
    got = load_and_snapshot(run, tmp_path)
    v = check_checkpoint_equivalence(first, got[0][0], run.layout)
    assert v.passed and got[0][1].step == 1
    # the next save that completes removes the orphans
    train_and_save(run, 2, tmp_path, block_bytes=BLOCK)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [INDEX_NAME] + [f.name for f in read_index(tmp_path).files]
    )


# ---- reads per rank --------------------------------------------------------------------------------


def test_each_rank_reads_only_the_files_and_blocks_overlapping_what_it_owns(ckpt):
    d, _ = ckpt
    ix = read_index(d)
    data_bytes = sum(f.nbytes - f.data_start for f in ix.files)
    run = cfg("zero3", 8).resolve()
    out = load_and_snapshot(run, d)
    reader = CheckpointReader(d, ix)
    for rank, (_, res) in enumerate(out):
        ranges = [(g0, g1) for g0, g1, _ in run.unit_plan.owned_global(rank)]
        assert set(res.stats.files_opened) == reader.files_for("master", ranges)
        assert len(res.stats.files_opened) == 1  # 4 -> 8 ranks: each new shard lies in one old file
        need = 3 * sum(b - a for a, b in ranges) * 4
        assert need <= res.stats.bytes_read < data_bytes / 2, (rank, res.stats)
    # the one rank of a world of 1 opens every file, each once
    single = load_and_snapshot(cfg("no_shard", 1), d)[0][1]
    assert sorted(single.stats.files_opened) == sorted(f.name for f in ix.files)


# ---- bad input: one line naming the tensor or file, nothing applied --------------------------------


def load_error(d, run_cfg=None, strict=True):
    """Load on fresh engines; every rank must raise the same error and keep its state untouched."""

    def body(engine, _schedule):
        before = engine_snapshot(engine)
        try:
            load_engine_state(engine, d, strict=strict)
        except ConfigError as e:
            after = engine_snapshot(engine)
            same = all(np.array_equal(before.states[k], after.states[k]) for k in before.states)
            return str(e), same and after.step == before.step
        return None, True

    results = run_engines(run_cfg or cfg("zero2", 3), body)
    messages = {m for m, _ in results}
    assert len(messages) == 1 and None not in messages, messages
    assert all(untouched for _, untouched in results)
    (msg,) = messages
    assert "\n" not in msg
    return msg


def test_missing_and_unexpected_tensors_strict(copy):
    edit_index(copy, lambda d: d["layout"]["tensors"][0].update(name="encoder.weight"))
    msg = load_error(copy)
    assert "missing tensors ['embedding.weight']" in msg and "unexpected tensors ['encoder.weight']" in msg


def test_missing_and_unexpected_tensors_non_strict_load_the_rest(copy, ckpt):
    edit_index(copy, lambda d: d["layout"]["tensors"][0].update(name="encoder.weight"))
    run = cfg("zero2", 3).resolve()
    out = load_and_snapshot(run, copy, strict=False)
    fresh = train_and_save(run, 0, None)[0]
    g0, g1 = run.layout.tensor_range("embedding.weight")
    saved = ckpt[1]
    for snap, res in out:
        assert res.missing_keys == ["embedding.weight"] and res.unexpected_keys == ["encoder.weight"]
        m = snap.states["master"]
        assert np.array_equal(m[:g1], fresh.states["master"][:g1])  # kept its own values
        assert np.array_equal(m[g1:], saved.states["master"][g1:])  # the rest loaded


def test_a_checkpoint_of_another_model(ckpt):
    other = SimModelConfig(vocab_size=64, d_model=16, n_layer=3, d_ff=64, seq_len=8, batch_size=2)
    msg = load_error(ckpt[0], cfg("zero2", 2, model=other))
    assert "missing tensors" in msg and "another model" in msg


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("shape", [16, 64], "tensor embedding.weight"),
        ("dtype", "float64", "tensor embedding.weight"),
    ],
)
def test_shape_or_dtype_mismatch_names_the_tensor(copy, field, value, needle):
    edit_index(copy, lambda d: d["layout"]["tensors"][0].update({field: value}))
    assert needle in load_error(copy)


def test_another_optimizer_or_state_dtype(copy):
    edit_index(copy, lambda d: d.update(state_dtype="float64"))
    assert "state_dtype" in load_error(copy)


@pytest.mark.parametrize(
    "damage, needle",
    [
        ("truncate", "truncated"),
        ("corrupt", "checksum mismatch"),
        ("delete", "does not exist"),
    ],
)
def test_a_damaged_or_missing_file_is_named(copy, damage, needle):
    f = read_index(copy).files[1]
    p = copy / f.name
    if damage == "truncate":
        p.write_bytes(p.read_bytes()[:-100])
    elif damage == "corrupt":
        raw = bytearray(p.read_bytes())
        raw[f.data_start + 10] ^= 0xFF
        p.write_bytes(bytes(raw))
    else:
        p.unlink()
    msg = load_error(copy)
    assert f.name in msg and needle in msg


def test_an_index_with_a_gap_or_of_another_format(copy):
    edit_index(copy, lambda d: d["files"].pop())
    with pytest.raises(ConfigError, match="unwritten"):
        read_index(copy)
    edit_index(copy, lambda d: d.update(format="something-else"))
    with pytest.raises(ConfigError, match="format"):
        read_index(copy)


# ---- offline reshard ---------------------------------------------------------------------------------


def test_offline_reshard_equals_what_engines_at_m_load(ckpt, tmp_path):
    d, saved = ckpt
    res = reshard(d, 3, "zero2", "deepspeed", tmp_path / "out", chunk_elems=1000)
    ix = res.index
    assert (ix.world_size, ix.strategy, ix.partitioner, ix.step) == (3, "shard_grad_op", "deepspeed", 2)
    assert inspect_checkpoint(tmp_path / "out").ok
    run = cfg("zero2", 3, partitioner="deepspeed").resolve()
    for snap, res_ in load_and_snapshot(run, tmp_path / "out"):
        assert check_checkpoint_equivalence(saved, snap, run.layout).passed
        assert len(res_.stats.files_opened) == 1  # the files are this plan's: each rank reads its own
    with pytest.raises(ConfigError, match="being read"):
        reshard(d, 2, "zero3", None, d)
    with pytest.raises(ConfigError, match="must divide"):
        reshard(d, 3, "hybrid_shard:2", None, tmp_path / "x")


# ---- CLI ---------------------------------------------------------------------------------------------


def test_cli_inspect_and_reshard(ckpt, copy, tmp_path, capsys):
    d, _ = ckpt
    assert main(["checkpoint", "inspect", str(d)]) == 0
    out = capsys.readouterr().out
    assert "world size 4" in out and "embedding.weight" in out and out.count("sha256 ok") == 4
    assert main(["checkpoint", "inspect", str(d), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["step"] == 2 and len(data["files"]) == 4
    f = read_index(copy).files[2]
    raw = bytearray((copy / f.name).read_bytes())
    raw[-1] ^= 1
    (copy / f.name).write_bytes(bytes(raw))
    assert main(["checkpoint", "inspect", str(copy)]) == 1
    err = capsys.readouterr().err
    assert f.name in err and "corrupted" in err
    assert main(["checkpoint", "inspect", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing" in err
    assert (
        main(
            ["checkpoint", "reshard", str(d), str(tmp_path / "r"), "--world-size", "2", "--strategy", "zero1"]
        )
        == 0
    )
    assert "world size 2" in capsys.readouterr().out and inspect_checkpoint(tmp_path / "r").ok
    assert (
        main(
            [
                "checkpoint",
                "reshard",
                str(d),
                str(tmp_path / "r2"),
                "--world-size",
                "2",
                "--strategy",
                "zero9",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.count("\n") == 1
