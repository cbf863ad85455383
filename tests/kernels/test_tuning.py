"""Tuning tables: nearest-bucket lookup, warned fallback, and the tuner end to end (interpreter)."""

import json
import warnings

import pytest

from interlace.tuning import tables as tuning
from interlace.tuning.tables import GemmConfig, ShapeClass, lookup, rows_bucket
from interlace import env

DEFAULT = GemmConfig(1, 2, 3, 4, 5)


@pytest.fixture()
def table_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("INTERLACE_TUNING_DIR", str(tmp_path))
    env.refresh()
    tuning.clear_cache()
    yield tmp_path
    tuning.clear_cache()


def write(table_dir, kernel, entries):
    key = tuning.table_key(kernel, "GPU X", 100)
    tuning.write_table(table_dir / f"{key}.json", entries, {})


def entry(hidden, bucket, bm):
    return {"shape": {"hidden": hidden, "ffn": 1024, "experts": 8, "activation": "swiglu"}, "bucket": bucket,
            "config": {"block_m": bm, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3}}


def test_missing_table_warns_once_and_uses_the_default(table_dir):
    shape = ShapeClass(2048, 1024, 8, "swiglu")
    with pytest.warns(UserWarning, match="no tuning table"):
        config, source = lookup("k", "GPU X", 100, shape, 300, DEFAULT)
    assert config == DEFAULT and source == "default (no table)"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second lookup must not warn again
        lookup("k", "GPU X", 100, shape, 300, DEFAULT)


def write_kin(table_dir, kernel, device, sms, triton_version, capability, block_m):
    """A table of another device or Triton version, with the meta lookup borrows by."""
    key = tuning.table_key(kernel, device, sms, triton_version)
    meta = {"device": device, "sm_count": sms, "triton": triton_version, "capability": list(capability)}
    tuning.write_table(table_dir / f"{key}.json", [entry(2048, 256, block_m)], meta)


def test_a_device_without_a_table_borrows_its_kin(table_dir):
    """No table for this device: the same device under another Triton version first, then a
    device of the same compute capability (nearest SM count, this Triton version first); each
    borrow warns once, and the source names the table it came from."""
    import triton

    shape = ShapeClass(2048, 1024, 8, "swiglu")
    write_kin(table_dir, "k", "GPU Y", 132, triton.__version__, (9, 0), 16)
    write_kin(table_dir, "k", "GPU Z", 114, triton.__version__, (9, 0), 32)
    write_kin(table_dir, "k", "GPU W", 132, triton.__version__, (8, 0), 64)
    with pytest.warns(UserWarning, match="borrowing k-GPU_Y-sm132"):
        config, source = lookup("k", "GPU X", 132, shape, 256, DEFAULT, (9, 0))
    assert config.block_m == 16 and source.startswith("borrowed from k-GPU_Y-sm132") and source.endswith("tuned")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per missing table
        assert lookup("k", "GPU X", 132, shape, 1024, DEFAULT, (9, 0))[0].block_m == 16
    with pytest.warns(UserWarning, match="borrowing k-GPU_Z-sm114"):  # nearest SM count: 114
        assert lookup("k", "GPU V", 110, shape, 256, DEFAULT, (9, 0))[0].block_m == 32
    with pytest.warns(UserWarning, match="borrowing k-GPU_W-sm132"):  # capability must match
        assert lookup("k", "GPU U", 132, shape, 256, DEFAULT, (8, 0))[0].block_m == 64
    with pytest.warns(UserWarning, match="using the default"):
        assert lookup("k", "GPU T", 132, shape, 256, DEFAULT, (10, 0)) == (DEFAULT, "default (no table)")
    with pytest.warns(UserWarning, match="using the default"):  # capability unknown: nothing is kin
        assert lookup("k", "GPU S", 132, shape, 256, DEFAULT)[0] == DEFAULT
    # the same device under another Triton version beats a same-capability device
    write_kin(table_dir, "k", "GPU X", 132, "0.0.1", (9, 0), 128)
    tuning.clear_cache()
    with pytest.warns(UserWarning, match="borrowing k-GPU_X-sm132-triton0.0.1"):
        assert lookup("k", "GPU X", 132, shape, 256, DEFAULT, (9, 0))[0].block_m == 128


def test_packaged_hopper_tables_are_kin(table_dir):
    """The packaged tables say their compute capability, so another Hopper part (an H100 PCIe,
    say) borrows them instead of running untuned defaults."""
    shape = ShapeClass(2048, 1408, 30, "swiglu")
    for kernel in ("expert_gemm0", "expert_gemm0_train", "expert_gemm1", "expert_bwd_act", "expert_bwd_dx",
                   "expert_wgrad"):
        with pytest.warns(UserWarning, match="borrowing"):
            config, source = lookup(kernel, "NVIDIA H100 PCIe", 114, shape, 512, DEFAULT, (9, 0))
        assert config != DEFAULT and source.startswith(f"borrowed from {kernel}-NVIDIA_H")


def test_tuning_one_preset_keeps_the_others_entries(tmp_path):
    """`interlace tune-experts --configs X` merges into an existing table: entries of shapes and
    buckets it did not measure stay, those it measured are replaced."""
    from interlace.tools.tune_experts import KERNELS, write_tables

    old = [entry(2048, 256, 16), entry(4096, 256, 32)]
    found = {k: [] for k in KERNELS}
    found["expert_gemm0"] = [entry(4096, 256, 64), entry(4096, 1024, 128)]
    write_tables(tmp_path, "GPU X", 100, {k: old for k in KERNELS}, 1.0, ["--first"], ["expert_gemm0"])
    path, = write_tables(tmp_path, "GPU X", 100, found, 2.0, ["--configs", "x"], ["expert_gemm0"])
    data = json.loads(path.read_text())
    got = {(e["shape"]["hidden"], e["bucket"]): e["config"]["block_m"] for e in data["entries"]}
    assert got == {(2048, 256): 16, (4096, 256): 64, (4096, 1024): 128}
    assert data["meta"]["kept"] == 1 and data["meta"]["previous"]["command"].endswith("--first")
    assert "capability" in data["meta"]


def test_nearest_bucket_then_nearest_shape(table_dir):
    write(table_dir, "k", [entry(2048, 64, 16), entry(2048, 1024, 32), entry(4096, 256, 64)])
    shape = ShapeClass(2048, 1024, 8, "swiglu")
    assert rows_bucket(300) == 256
    config, source = lookup("k", "GPU X", 100, shape, 1024, DEFAULT)
    assert config.block_m == 32 and source == "tuned"
    config, source = lookup("k", "GPU X", 100, shape, 700, DEFAULT)  # bucket 512: nearest is 1024
    assert config.block_m == 32 and "nearest" in source
    config, _ = lookup("k", "GPU X", 100, ShapeClass(4096, 1024, 8, "swiglu"), 100, DEFAULT)
    assert config.block_m == 64  # same shape class wins over a closer bucket of another class


def test_lookups_are_remembered_until_a_table_is_written(table_dir):
    """Lookups are cached per (table, shape, bucket); writing a table (the tuner) drops them, so a
    re-tuned entry is seen at once."""
    shape = ShapeClass(2048, 1024, 8, "swiglu")
    write(table_dir, "k", [entry(2048, 256, 16)])
    assert lookup("k", "GPU X", 100, shape, 256, DEFAULT)[0].block_m == 16
    (table_dir / f"{tuning.table_key('k', 'GPU X', 100)}.json").unlink()  # cached: the file is not read again
    assert lookup("k", "GPU X", 100, shape, 256, DEFAULT)[0].block_m == 16
    write(table_dir, "k", [entry(2048, 256, 64)])
    assert lookup("k", "GPU X", 100, shape, 256, DEFAULT)[0].block_m == 64


def test_tuner_writes_tables_that_lookup_finds(table_dir):
    from interlace.tools.tune_experts import main

    # 1 expert, 16 rows (qwen3-30b-a3b: the presets' smallest FFN, 768, the interpreted GEMMs' cost)
    main(["--configs", "qwen3-30b-a3b", "--world", "128", "--tokens", "2", "--out", str(table_dir)])
    files = sorted(p.name for p in table_dir.glob("*.json"))
    kernels = ["expert_bwd_act", "expert_bwd_dx", "expert_gemm0", "expert_gemm0_train", "expert_gemm1", "expert_wgrad"]
    assert [f.split("-cpu-sm1")[0] for f in files] == kernels
    for f in files:
        entries = json.loads((table_dir / f).read_text())["entries"]
        assert {e["bucket"] for e in entries} == {16} and all(e["tflops"] > 0 for e in entries)
    # what the tuner wrote is what lookup returns for that shape and bucket
    entry = json.loads((table_dir / files[2]).read_text())["entries"][0]
    config, source = lookup("expert_gemm0", "cpu", 1, ShapeClass(**entry["shape"]), 16, DEFAULT)
    assert source == "tuned" and config == GemmConfig(**entry["config"])
    # --kernels: only the named kernels are tuned and only their tables written
    only = table_dir / "only"
    main(["--configs", "qwen3-30b-a3b", "--world", "128", "--tokens", "2", "--kernels", "expert_gemm1", "--rounds",
          "2", "--out", str(only)])
    assert [p.name.split("-cpu-sm1")[0] for p in only.glob("*.json")] == ["expert_gemm1"]
    assert [e["rounds"] for e in json.loads(next(only.glob("*.json")).read_text())["entries"]] == [2]


def test_fused_split_pick_keeps_the_table_unless_clearly_beaten():
    """`interlace tune` compares splits by their median over interleaved rounds and keeps the
    tabled split unless a candidate is faster by more than the margin."""
    from interlace.tools.tune_fused import pick_split

    samples = {4: [0.90, 1.30, 1.00], 8: [0.95, 0.99, 1.40], 16: [1.00, 1.01, 1.02]}  # medians 1.00, 0.99, 1.01
    assert pick_split(samples, incumbent=None, margin=0.02) == 8  # by the median, not the one fastest call (4's)
    assert pick_split(samples, incumbent=16, margin=0.02) == 16  # 0.99 vs 1.01: under 2% better, the table stays
    assert pick_split(samples, incumbent=16, margin=0.0) == 8
    assert pick_split(samples, incumbent=32, margin=0.02) == 8  # a tabled value that was not timed cannot stay
    samples[8] = [0.90, 0.91, 0.92]  # now 10% faster than the incumbent
    assert pick_split(samples, incumbent=16, margin=0.02) == 8
    assert pick_split({4: [1.0], 8: [1.0]}, incumbent=None, margin=0.02) == 4  # ties: the smaller split


def test_tuner_picks_the_lowest_median_over_rounds():
    """`interlace tune-experts` times the candidates in interleaved rounds and keeps the lowest
    median, not the one fastest call; ties go to the earlier candidate (the default first)."""
    from interlace.tools.tune_experts import pick_config

    samples = [[1.00, 1.00, 1.00], [0.80, 1.20, 1.10], [0.95, 0.99, 2.00]]  # medians 1.00, 1.10, 0.99
    assert pick_config(samples) == 2
    assert pick_config([[1.0, 2.0, 3.0], [2.0, 2.0, 2.5]]) == 0  # equal medians: the earlier
    assert pick_config([[5.0]]) == 0


def test_tuner_rows_are_ragged_around_the_bucket():
    """The tuner times experts whose rows end mid-block (within ±1/8 of the bucket, the total
    exact), not equal multiples of the block that real routing never gives."""
    import torch

    from interlace.tools.tune_experts import ragged_ends

    for bucket, experts in ((256, 128), (2048, 4), (64, 7), (1, 3)):
        ends = ragged_ends(bucket, experts, "cpu")
        counts = torch.diff(ends.long(), prepend=torch.zeros(1, dtype=torch.long))
        assert ends.dtype == torch.int32 and int(ends[-1]) == bucket * experts
        assert (counts >= bucket - bucket // 8).all() and (counts <= bucket + bucket // 8).all()
    counts = torch.diff(ragged_ends(256, 128, "cpu").long(), prepend=torch.zeros(1, dtype=torch.long))
    assert (counts % 64 != 0).sum() > 64  # most experts end inside a 64-row block


def test_expert_config_choice_is_memoized_until_tables_change(table_dir, monkeypatch):
    """The expert block chooses its five configs on every call; the answer is memoized per
    shape, rows bucket and kernel options, and a written table or an option still takes effect."""
    from types import SimpleNamespace

    import torch

    import interlace.kernels.expert_gemm.configs as gg

    monkeypatch.setattr(gg, "device_identity", lambda index: ("GPU X", 100, (9, 0)))
    calls = []
    real_lookup = gg.lookup

    def counting_lookup(*args, **kwargs):
        calls.append(args[0])
        return real_lookup(*args, **kwargs)

    monkeypatch.setattr(gg, "lookup", counting_lookup)
    x = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))  # the CUDA path, on the CPU
    w_down = torch.empty(8, 2048, 1024)
    write(table_dir, "expert_gemm0", [entry(2048, 256, 64)])
    write(table_dir, "expert_gemm1", [entry(2048, 256, 32)])
    c0, c1, source = gg.choose_configs(x, w_down, 8 * 256, "swiglu")
    assert (c0.block_m, c1.block_m) == (64, 32) and source == "gemm0 tuned; gemm1 tuned"
    assert len(calls) == 2
    assert gg.choose_configs(x, w_down, 8 * 250, "swiglu") == (c0, c1, source)  # same bucket: memoized
    assert len(calls) == 2
    gg.choose_configs(x, w_down, 8 * 1024, "swiglu")  # another bucket: looked up
    assert len(calls) == 4
    write(table_dir, "expert_gemm0", [entry(2048, 256, 16)])  # a new table expires the memo
    assert gg.choose_configs(x, w_down, 8 * 256, "swiglu")[0].block_m == 16
    forced = gg.ExpertKernelOptions(gemm0=GemmConfig(128, 128, 64, 8, 4))  # so does an option
    c0, _, source = gg.choose_configs(x, w_down, 8 * 256, "swiglu", options=forced)
    assert c0.block_m == 128 and source.startswith("gemm0 options")


def test_training_forward_takes_gemm0_from_its_own_table(table_dir, monkeypatch):
    """A forward that stores h (training) reads GEMM0's config from ``expert_gemm0_train``, timed
    storing h; the inference forward from ``expert_gemm0``. A device with neither that table nor a
    kin's takes the inference table's GEMM0, not the untuned default, and no warning says
    otherwise; the call site passes ``store_h`` through."""
    from types import SimpleNamespace

    import torch

    import interlace.kernels.expert_gemm.configs as gg
    import interlace.kernels.expert_gemm.forward as forward

    monkeypatch.setattr(gg, "device_identity", lambda index: ("GPU X", 100, (1, 0)))  # no kin anywhere
    x = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))  # the CUDA path, on the CPU
    w_down = torch.empty(8, 2048, 1024)
    write(table_dir, "expert_gemm0", [entry(2048, 256, 64)])
    write(table_dir, "expert_gemm1", [entry(2048, 256, 32)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c0, c1, source = gg.choose_configs(x, w_down, 8 * 256, "swiglu", store_h=True)
    assert (c0.block_m, c1.block_m) == (64, 32), source
    assert source == "gemm0_train from expert_gemm0, tuned; gemm1 tuned"
    write(table_dir, "expert_gemm0_train", [entry(2048, 256, 16)])
    c0, c1, source = gg.choose_configs(x, w_down, 8 * 256, "swiglu", store_h=True)
    assert (c0.block_m, c1.block_m) == (16, 32) and source == "gemm0_train tuned; gemm1 tuned"
    assert gg.choose_configs(x, w_down, 8 * 256, "swiglu")[:2] == (gg.GemmConfig(64, 128, 64, 8, 3),
                                                                   gg.GemmConfig(32, 128, 64, 8, 3))
    seen = []
    real = gg.choose_configs
    monkeypatch.setattr(forward, "choose_configs", lambda *a, **kw: (seen.append(a[4:] or kw.get("store_h")),
                                                                      real(*a, **kw))[1])
    xs, w_up, w_dn = torch.randn(5, 16), torch.randn(2, 48, 16), torch.randn(2, 16, 24)
    ends = torch.tensor([2, 5], dtype=torch.int32)
    for store_h in (False, True):
        forward.expert_ffn_triton(xs, None, 1, 5, w_up, w_dn, ends, "swiglu", store_h=store_h)
    assert seen == [(False,), (True,)], seen


def test_packaged_expert_tables_hold_only_kernel_forms_that_exist():
    """Every entry of the packaged expert tables reads as a GemmConfig the kernels accept."""
    from interlace.kernels.expert_gemm.configs import check_config
    from interlace.tuning.tables import PACKAGED_DIR, config_from_entry

    paths = sorted(PACKAGED_DIR.glob("expert_*.json"))
    assert paths
    for path in paths:
        for e in json.loads(path.read_text())["entries"]:
            check_config(config_from_entry(e["config"]))


def test_retired_config_fields_read_at_their_old_default_only():
    """A table written before ``flatten`` and ``chain`` went still loads where they are 0; any
    other value names the field (its kernel form is gone)."""
    from interlace.tuning.tables import config_from_entry, parse_config

    base = {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3}
    assert config_from_entry({**base, "flatten": 0, "chain": 0}) == GemmConfig(64, 128, 64, 8, 3)
    with pytest.raises(ValueError, match="chain"):
        config_from_entry({**base, "chain": 1})
    assert parse_config("64,128,64,8,3,16,a_tma=1,persistent=2") == GemmConfig(64, 128, 64, 8, 3, 16, a_tma=1,
                                                                                persistent=2)
