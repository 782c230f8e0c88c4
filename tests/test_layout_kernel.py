"""The fused CPU kernel of the HAWK transformation: byte for byte the eager torch path."""

import fcntl
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hardware import kernel_build, layout_bench, layout_kernel, tiles, transform
from hardware.mechanism_plans import hawk_segments
from test_layout_nonfinite import kernel_pack, narrow_source
from test_layout_transform import make_transfer, numpy_send_buffer

DTYPES = ["bfloat16", "bfloat8_b", "bfloat4_b", "float32"]
FIXTURES = {name: np.load(Path(__file__).parent / "data" / f"ttnn-{name}.npz")
            for name in ("golden", "nonfinite")}        # ttnn's own bytes
CACHE_DTYPES = {"bfloat16": ["bfloat16"], "float32": ["float32"],
                "bfloat8_b": ["bfloat16", "float16", "float32"],
                "bfloat4_b": ["bfloat16", "float16", "float32"]}


@pytest.fixture(scope="module")
def kernel():
    """Build the kernel once per test run (seconds; a cached build loads at once), or skip."""
    if not layout_kernel.enabled():
        pytest.skip(f"{layout_kernel.ENV_VAR}=0 turns the fused kernel off")
    if not layout_kernel.available():
        pytest.skip("the fused kernel could not be built here (compiler, ninja or build "
                    "error; see the debug log of hardware.layout_kernel)")


def special_layers(req, rng, nan=True):
    """Random layers with zeros, signed zeros, denormals, large values, inf and NaN mixed in,
    over a wide range of group scales."""
    dtype = transform.TORCH_DTYPES[req.gpu.dtype]
    info = torch.finfo(dtype)
    layers = []
    for _ in range(req.gpu.num_layers):
        shape = req.gpu.physical_shape
        x = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, shape[:-1] + (1,)))
        pick = rng.random(shape)
        x[pick < 0.05] = 0.0
        x[(pick >= 0.05) & (pick < 0.07)] = -0.0
        tiny = (pick >= 0.07) & (pick < 0.10)
        x[tiny] = rng.standard_normal(tiny.sum()) * info.smallest_normal * 0.3   # denormals
        x[(pick >= 0.10) & (pick < 0.11)] = info.max * rng.choice([-1, 1])
        x[(pick >= 0.11) & (pick < 0.112)] = np.inf * rng.choice([-1, 1])
        x[(pick >= 0.112) & (pick < 0.113)] = np.nan if nan else 1.0
        layers.append(torch.from_numpy(x).to(dtype))
    return layers


def random_bit_layers(req, rng):
    """Layers of uniformly random bit patterns: every value class of the cache dtype."""
    dtype = transform.TORCH_DTYPES[req.gpu.dtype]
    bits = {2: (np.uint16, torch.int16), 4: (np.uint32, torch.int32)}[torch.finfo(dtype).bits // 8]
    return [torch.from_numpy(rng.integers(0, np.iinfo(bits[0]).max, req.gpu.physical_shape,
                                          dtype=bits[0], endpoint=True).view(bits[0]))
            .view(bits[1]).view(dtype) for _ in range(req.gpu.num_layers)]


def random_transfer(rng, dtype):
    return make_transfer(rng, int(rng.integers(1, 230)), int(rng.integers(1, 4)),
                         int(rng.choice([32, 64, 128])), int(rng.choice([16, 32, 48])),
                         str(rng.choice(["NHD", "HND"])), int(rng.choice([32, 64])), dtype,
                         int(rng.integers(1, 13)), alignment=int(rng.choice([32, 64, 128])),
                         gpu_dtype=str(rng.choice(CACHE_DTYPES[dtype])))


def both_paths(layers, req, kind):
    gather = transform.prepare(req, kind)
    make = transform.hawk_transform if kind == "hawk" else transform.page_order_transform
    assert transform.uses_kernel(layers, req, gather)
    fused = make(layers, req, gather=gather, kernel=True)
    eager = make(layers, req, gather=gather, kernel=False)
    return fused, eager, gather


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_kernel_equals_eager(kernel, dtype, seed):
    # token counts not multiples of 32, both orders, 1..12 banks, both plan kinds, specials
    rng = np.random.default_rng([seed, DTYPES.index(dtype)])
    for _ in range(4):
        req = random_transfer(rng, dtype)
        layers = special_layers(req, rng)
        for kind in ("hawk", "per_page"):
            fused, eager, _ = both_paths(layers, req, kind)
            assert torch.equal(fused, eager), (kind, req.gpu, req.tt, req.num_tokens)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_eager_on_any_bit_pattern(kernel, dtype):
    rng = np.random.default_rng(DTYPES.index(dtype))
    for _ in range(6):
        req = random_transfer(rng, dtype)
        fused, eager, _ = both_paths(random_bit_layers(req, rng), req, "hawk")
        assert torch.equal(fused, eager), (req.gpu, req.tt, req.num_tokens)


@pytest.mark.parametrize("banks", range(1, 13))
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_kernel_gives_the_numpy_bytes(kernel, banks, order):
    # no NaN: bfloat16 sent as it is keeps a NaN's bits, where numpy's packing writes 0x7FC0
    rng = np.random.default_rng(banks)
    for dtype in ("bfloat16", "bfloat8_b", "bfloat4_b"):
        req = make_transfer(rng, 77 + 30 * banks, 2, 64, 16, order, 32, dtype, banks)
        layers = special_layers(req, rng, nan=False)
        fused, eager, gather = both_paths(layers, req, "hawk")
        want = numpy_send_buffer(layers, req, hawk_segments(req)[0], gather.stride)
        assert np.array_equal(fused.numpy(), want) and torch.equal(fused, eager)


def test_kernel_fills_a_given_send_buffer(kernel):
    req = make_transfer(np.random.default_rng(4), 90, 2, 64, 16, "NHD", 32, "bfloat8_b", 7,
                        alignment=128)                      # page stride > page bytes
    layers = transform.make_gpu_cache(req.gpu, torch.Generator().manual_seed(4))
    out = torch.full((transform.prepare(req).stride * 2 * req.pages_per_tensor * 2,), 7,
                     dtype=torch.uint8)
    assert transform.hawk_transform(layers, req, out=out, kernel=True) is out
    assert torch.equal(out, transform.hawk_transform(layers, req, kernel=False))
    for dtype in ("bfloat16", "float32"):                   # a send buffer at an odd address
        req = make_transfer(np.random.default_rng(5), 90, 2, 64, 16, "HND", 32, dtype, 5,
                            gpu_dtype=dtype)
        layers = transform.make_gpu_cache(req.gpu, torch.Generator().manual_seed(5))
        want = transform.hawk_transform(layers, req, kernel=False)
        region = torch.zeros(want.numel() + 1, dtype=torch.uint8)
        transform.hawk_transform(layers, req, out=region[1:], kernel=True)
        assert torch.equal(region[1:], want)


@pytest.mark.parametrize("path", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_bytes_do_not_depend_on_the_number_of_threads(kernel, dtype, path):
    # 1000 tokens, 2 heads of 128: 512 pages a layer, split over the threads where torch has two
    cpu_path(path)
    rng = np.random.default_rng(11)
    req = make_transfer(rng, 1000, 2, 128, 16, "NHD", 32, dtype, 7,
                        gpu_dtype=CACHE_DTYPES[dtype][0])
    layers = special_layers(req, rng)
    eager = transform.hawk_transform(layers, req, kernel=False)
    threads = torch.get_num_threads()
    try:
        with layout_kernel.forcing(path):
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                assert torch.equal(transform.hawk_transform(layers, req, kernel=True), eager), n
    finally:
        torch.set_num_threads(threads)


def test_kernel_refuses_a_send_row_given_to_two_pages(kernel):
    req = make_transfer(np.random.default_rng(12), 64, 1, 64, 16, "NHD", 32, "bfloat8_b", 3)
    gather = transform.prepare(req)
    send_rows = torch.from_numpy(gather.tiles.send_rows.copy())
    send_rows[1] = send_rows[0]
    rows = torch.zeros(send_rows.numel(), gather.stride, dtype=torch.uint8)
    layer = transform.make_gpu_cache(req.gpu)[0]
    with pytest.raises(RuntimeError, match=f"send row {int(send_rows[0])} is given to two pages"):
        layout_kernel.pack_layer(layer, torch.from_numpy(gather.tiles.sources), send_rows,
                                 rows[:, :req.tt.page_bytes], req.tt.dtype)


def pack_pages(layers, req, offset, path):
    """The kernel's send rows of each layer by ``path``, built at ``offset`` bytes past a
    64-byte aligned buffer full of 0xAB (offset 1: no streamed stores), as [layers, pages,
    stride] bytes."""
    gather = transform.prepare(req)
    sources = torch.from_numpy(gather.tiles.sources)
    send_rows = torch.from_numpy(gather.tiles.send_rows)
    pages, stride = sources.shape[0], gather.stride
    results = []
    for layer in layers:
        region = torch.full((pages * stride + 64,), 0xAB, dtype=torch.uint8)
        start = (-region.data_ptr()) % 64 + offset
        rows = region[start:start + pages * stride].view(pages, stride)
        layout_kernel.pack_layer(layer, sources, send_rows, rows[:, :req.tt.page_bytes],
                                 req.tt.dtype, path=path)
        results.append(rows.clone())
    return torch.stack(results)


def cpu_path(path):
    """Skip unless this CPU runs ``path``."""
    if path not in layout_kernel.supported_paths():
        pytest.skip(f"this CPU lacks the {path} path's instructions")
    return path


@pytest.mark.parametrize("path", ["avx512", "avx2"])
@pytest.mark.parametrize("dtype", ["bfloat8_b", "bfloat4_b"])
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16", "float32"])
def test_vector_packing_equals_portable_packing(kernel, path, dtype, cache_dtype):
    # each vector path (bfloat16 sources, where the CPU has it) against the portable one and
    # the eager torch path, both orders, any bits and the special values, streamed (aligned)
    # and plain (odd) stores
    cpu_path(path)
    rng = np.random.default_rng([DTYPES.index(dtype), CACHE_DTYPES[dtype].index(cache_dtype)])
    for i in range(6):
        req = make_transfer(rng, int(rng.integers(1, 200)), int(rng.integers(1, 4)),
                            int(rng.choice([32, 64, 128])), 16, ["NHD", "HND"][i % 2], 32, dtype,
                            int(rng.integers(1, 13)), alignment=64, gpu_dtype=cache_dtype)
        layers = special_layers(req, rng) if i < 3 else random_bit_layers(req, rng)
        for offset in (0, 1, 32):
            vector = pack_pages(layers, req, offset, path)
            assert torch.equal(vector, pack_pages(layers, req, offset, "portable")), offset
        eager = transform.hawk_transform(layers, req, kernel=False).view(vector.shape)
        assert torch.equal(vector[..., :req.tt.page_bytes], eager[..., :req.tt.page_bytes])


@pytest.mark.parametrize("path", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("dtype", ["bfloat8_b", "bfloat4_b"])
def test_every_bfloat16_value_packs_alike_on_every_path(kernel, path, dtype):
    # all 65536 bfloat16 bit patterns, each beside group mates that set every shared exponent
    # 0..255 in turn: each code against the numpy packing of hardware.tiles
    cpu_path(path)
    values = np.arange(1 << 16, dtype=np.uint32)                     # [65536] bit patterns
    rng = np.random.default_rng(7)
    for shift in range(0, 256, 51):
        groups = values.reshape(-1, 16).copy()                          # [4096, 16]
        big = (rng.integers(0, 256, len(groups)) + shift) % 256        # a mate's exponent
        groups[:, 0] = (groups[:, 0] & 0x807F) | (big << 7).astype(np.uint32)
        x = (groups.reshape(-1, 32, 32) << 16).view(np.float32)          # tiles [128, 32, 32]
        want = tiles.pack(x, dtype)[0]
        layer = torch.from_numpy((groups.astype(np.uint16)).view(np.int16)).view(torch.bfloat16)
        sources = torch.arange(len(x) * 32, dtype=torch.int64).view(-1, 32) * 32
        out = torch.full((len(x), tiles.FORMATS[dtype].tile_bytes), 0xAB, dtype=torch.uint8)
        layout_kernel.pack_layer(layer.reshape(-1).contiguous(), sources,
                                 torch.arange(len(x)), out, dtype, path=path)
        assert np.array_equal(out.numpy().reshape(-1), want), shift


@pytest.mark.parametrize("path", ["avx512", "avx2", "portable"])
def test_every_path_gives_the_ttnn_fixture_bytes(kernel, path):
    # every block-float case of both ttnn fixtures, from float32 and from each narrow cache
    # dtype that holds its input exactly (bfloat16: the vector paths' own input)
    cpu_path(path)
    from_bfloat16 = 0
    for name, fixture in FIXTURES.items():
        for k in range(int(fixture["n_cases"])):
            dtype = str(fixture[f"dtype_{k}"])
            if dtype not in ("bfloat8_b", "bfloat4_b"):
                continue
            x = fixture[f"input_{k}"]
            for source in ("float32", "bfloat16", "float16"):
                layer = torch.from_numpy(x) if source == "float32" else narrow_source(x, source)
                if layer is None:
                    continue
                with layout_kernel.forcing(path):
                    got = kernel_pack(layer, dtype, portable=False)
                assert np.array_equal(got, fixture[f"packed_{k}"]), (name, k, source)
                from_bfloat16 += source == "bfloat16"
    assert from_bfloat16 >= 5


def test_kernel_runs_the_paths_the_cpu_has(kernel):
    import platform
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() in ("x86_64", "AMD64") and not cpuinfo.exists():
        pytest.skip("the CPU's flags are read from /proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    has = {f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl")
           if f" {f}" in flags}
    want = ["portable"]
    if {"avx2", "fma", "f16c"} <= has:
        want.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl"} <= has:
            want.append("avx512")
    assert layout_kernel.supported_paths() == tuple(want)
    assert layout_kernel.best_path() == want[-1]


def test_kernel_refuses_a_path_by_name(kernel, monkeypatch):
    req = make_transfer(np.random.default_rng(13), 40, 1, 64, 16, "NHD", 32, "bfloat8_b", 3)
    layers = transform.make_gpu_cache(req.gpu)
    monkeypatch.setenv(layout_kernel.PATH_VAR, "avx3")
    with pytest.raises(ValueError, match="HAWK_TRANSFORM_PATH='avx3'.*allowed: auto, portable"):
        transform.hawk_transform(layers, req, kernel=True)
    monkeypatch.setenv(layout_kernel.PATH_VAR, "portable")
    assert torch.equal(transform.hawk_transform(layers, req, kernel=True),
                       transform.hawk_transform(layers, req, kernel=False))
    lacking = [p for p in layout_kernel.PATHS if p not in layout_kernel.supported_paths()]
    for path in lacking:            # only on CPUs without AVX2 or AVX-512
        with pytest.raises(ValueError, match=f"{path}.*lacks its instructions"):
            layout_kernel.pack_layer(layers[0], torch.zeros(0, 32, dtype=torch.int64),
                                     torch.zeros(0, dtype=torch.int64),
                                     torch.zeros(0, 1088, dtype=torch.uint8), "bfloat8_b",
                                     path=path)


def test_kernel_is_used_only_where_it_applies(kernel, monkeypatch):
    rng = np.random.default_rng(9)
    req = make_transfer(rng, 50, 2, 64, 16, "NHD", 32, "bfloat8_b", 8)
    layers = transform.make_gpu_cache(req.gpu)
    gather = transform.prepare(req)
    assert transform.uses_kernel(layers, req, gather)
    assert not transform.uses_kernel(layers, req, gather, kernel=False)
    narrowing = make_transfer(rng, 50, 2, 64, 16, "NHD", 32, "bfloat16", 8, gpu_dtype="float16")
    odd_head = make_transfer(rng, 50, 2, 48, 16, "NHD", 32, "bfloat8_b", 8)
    for r in (narrowing, odd_head):                          # eager: float16 -> bfloat16
        layers = transform.make_gpu_cache(r.gpu)             # rounding; unit gather
        assert not transform.uses_kernel(layers, r, transform.prepare(r))
        with pytest.raises(ValueError, match="does not pack"):
            transform.hawk_transform(layers, r, kernel=True)
    monkeypatch.setenv(layout_kernel.ENV_VAR, "0")
    layers = transform.make_gpu_cache(req.gpu)
    assert not transform.uses_kernel(layers, req, gather)
    with pytest.raises(RuntimeError, match="could not be built"):
        transform.hawk_transform(layers, req, kernel=True)


def test_failed_build_falls_back_to_eager(monkeypatch, caplog, tmp_path):
    from torch.utils import cpp_extension

    def fail(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.delenv(layout_kernel.ENV_VAR, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))       # no finished build there
    monkeypatch.setattr(cpp_extension, "load", fail)
    monkeypatch.setattr(layout_kernel, "_BUILDS", {})
    req = make_transfer(np.random.default_rng(3), 40, 1, 64, 16, "HND", 32, "bfloat8_b", 5)
    layers = transform.make_gpu_cache(req.gpu, torch.Generator().manual_seed(3))
    with caplog.at_level(logging.DEBUG, logger="hardware.layout_kernel"):
        assert not layout_kernel.available()
        out = transform.hawk_transform(layers, req)
    assert "no compiler here" in caplog.text
    assert torch.equal(out, transform.hawk_transform(layers, req, kernel=False))


def test_a_finished_build_loads_while_another_process_holds_the_lock(kernel):
    # the library a build left is loaded at once: no lock, no ninja run, no wait
    built = layout_kernel.warm_up()[0]
    assert built.directory == kernel_build.build_directory(layout_kernel._spec(False))
    assert built.library.parent == built.directory and built.library.is_file()
    probe = "from hardware import layout_kernel as k; print(k.available())"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           kernel_build.WAIT_VAR: "0"}
    with open(built.directory / kernel_build.LOCK, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                              text=True, timeout=300)
    assert done.stdout.split() == ["True"], done.stderr
    assert "hardware.layout_kernel:" not in done.stderr


def test_build_command_says_where_and_how_long(kernel, capsys):
    assert layout_kernel.main(["--build"]) == 0
    out = capsys.readouterr().out.splitlines()
    names = ["hawk_layout"] + (["hawk_layout_omp"] if layout_kernel._openmp() else [])
    assert [line.split(":")[0] for line in out] == names
    for name, line in zip(names, out):
        directory = kernel_build.build_directory(layout_kernel._spec(name.endswith("omp")))
        assert " in " in line and line.endswith(".so") and str(directory) in line


def test_benchmark_names_the_path_and_both_ratios():
    result = layout_bench.run(tokens=128, repeats=1, bench_layers=1, tp=8, dram="wormhole")
    text = layout_bench.format_table(result)
    for t in result["throughput"]:
        kernel = t["path"] == "fused C++ kernel"
        assert kernel == layout_kernel.available()
        assert ("eager_ratio" in t) == kernel
        if kernel:
            assert t["eager_ratio"] == pytest.approx(t["copy_s"] / t["eager_s"])
    assert ("eager torch path: ratio" in text) == layout_kernel.available()
