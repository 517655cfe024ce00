"""benchmarks/carry_vllm.py on small wheels made here: the site laid out as pip --target would (trims dropped,
RECORD rewritten), parts within the budget, each part checked and extracted on its own, the site complete only
with every part, a tampered part refused, and the markers that decide which requirements a wheel brings."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import zipfile
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def carry():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import carry_vllm

        yield carry_vllm
    finally:
        sys.path.remove(str(BENCHMARKS))


def make_wheel(directory: Path, name: str, files: dict[str, bytes], requires: tuple[str, ...] = ()) -> Path:
    dist = f"{name}-1.0.dist-info"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: 1.0\n{}".format(
        name, "".join(f"Requires-Dist: {r}\n" for r in requires))
    path = directory / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for arcname, data in {**files, f"{dist}/METADATA": meta.encode(), f"{dist}/RECORD": b"stale\n"}.items():
            z.writestr(arcname, data)
    return path


def test_site_files_lay_out_like_pip_target_and_drop_trims(carry, tmp_path):
    wheel = make_wheel(tmp_path, "vllm", {
        "vllm/__init__.py": b"x = 1\n",
        "vllm/vllm-rs": b"\x7fELF" + b"\0" * 100,  # trimmed: the Rust frontend
        "vllm/vllm_flash_attn/cute/interface.py": b"import cutlass\n",  # trimmed: FA4
        "vllm-1.0.data/purelib/vllm_extra.py": b"y = 2\n",
        "vllm-1.0.data/scripts/vllm": b"#!python\n",
        "vllm-1.0.data/headers/x.h": b"int x;\n",
    })
    files, trimmed = carry.site_files(wheel)
    names = [name for name, _, _ in files]
    assert names == ["bin/vllm", "vllm-1.0.dist-info/METADATA", "vllm-1.0.dist-info/RECORD", "vllm/__init__.py",
                     "vllm_extra.py"]
    assert trimmed == 104 + len(b"import cutlass\n")
    record = {n: d for n, d, _ in files}["vllm-1.0.dist-info/RECORD"].decode().splitlines()
    rows = {line.split(",")[0]: line for line in record}
    assert set(rows) == set(names)  # the kept files, nothing trimmed, nothing stale
    assert rows["vllm/__init__.py"].endswith(",6")
    assert carry.trim_reason("vllm/_moe_C_stable_libtorch.abi3.so")
    assert carry.trim_reason("vllm/_C_stable_libtorch.abi3.so") is None


def test_fit_uses_as_few_parts_as_first_fit_and_spreads_them(carry):
    sizes = [60, 30, 30, 10]  # first fit alone: 100 + 30; spread over its two parts: 70 + 60
    parts = carry.fit(sizes, 100)
    assert sorted(i for p in parts for i in p) == list(range(len(sizes)))
    assert sorted(sum(sizes[i] for i in p) for p in parts) == [60, 70]
    sizes = [50, 50, 40, 30, 30]  # spread would put 110 in one part: first fit's 100 + 100 stays
    assert sorted(sum(sizes[i] for i in p) for p in carry.fit(sizes, 100)) == [100, 100]
    with pytest.raises(SystemExit, match="over the part budget"):
        carry.fit([10, 90], 80)


def test_parts_unpack_one_at_a_time_and_complete_the_site(carry, tmp_path):
    wheels_dir = tmp_path / "wheels"
    wheels_dir.mkdir()
    blobs = {n: os.urandom(300_000) for n in ("a", "b", "c")}  # incompressible: one chunk each, ~293 KiB xz
    wheels = [make_wheel(wheels_dir, f"pkg_{n}", {f"pkg_{n}/data.bin": blob}) for n, blob in blobs.items()]
    parts = tmp_path / "parts"
    result = carry.write_parts(wheels, parts, tmp_path / "xz", budget=700_000, preset=1, jobs=1)
    assert result["device_calls"] == 2 and all(p["mib"] * carry.MiB <= 700_000 for p in result["parts"])
    sums = (parts / "SHA256SUMS").read_text().split()
    assert sums[1::2] == ["part-00.tar.xz", "part-01.tar.xz"]

    site = tmp_path / "site"
    first = carry.unpack(carry.argparse.Namespace(parts=parts, site=site, n=1))
    assert first["parts_in"] == [1] and first["parts_missing"] == [0] and "check" not in first

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "SHA256SUMS").write_text((parts / "SHA256SUMS").read_text())
    data = bytearray((parts / "part-00.tar.xz").read_bytes())
    data[len(data) // 2] ^= 1
    (broken / "part-00.tar.xz").write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="sha256 differs"):
        carry.unpack(carry.argparse.Namespace(parts=broken, site=site, n=0))

    second = carry.unpack(carry.argparse.Namespace(parts=parts, site=site, n=None))  # every part not yet in
    assert [u["part"] for u in second["unpacked"]] == [0]
    assert second["parts_missing"] == []
    assert set(second["check"]) == {"import_ok", "import_s", "output_tail", "unmet_requirements"}
    assert second["check"]["unmet_requirements"] == []
    for n, blob in blobs.items():
        assert (site / f"pkg_{n}" / "data.bin").read_bytes() == blob
        assert (site / f"pkg_{n}-1.0.dist-info" / "RECORD").is_file()
    with pytest.raises(SystemExit, match="that the site lacks"):
        carry.unpack(carry.argparse.Namespace(parts=parts, site=site, n=None))

    # a new pack replaces the site instead of mixing with it
    carry.write_parts(wheels[:1], parts, tmp_path / "xz", budget=700_000, preset=1, jobs=1)
    third = carry.unpack(carry.argparse.Namespace(parts=parts, site=site, n=0))
    assert third["parts_missing"] == [] and not (site / "pkg_b").exists()


def test_requirements_follow_the_targets_markers(carry, tmp_path):
    wheel = carry.Wheel(make_wheel(tmp_path, "pkg", {"pkg/__init__.py": b""}, requires=(
        "plain>=1", "newer; python_version > '3.11'", "older; python_version < '3.11'",
        "windows; sys_platform == 'win32'", "extra-only; extra == 'image'")))
    assert [r.name for r in wheel.needs("")] == ["plain", "newer"]
    assert [r.name for r in wheel.needs("image")] == ["newer", "extra-only"]


def test_smoke_plans_without_downloading(carry, tmp_path, capsys):
    wheel = make_wheel(tmp_path, "pkg", {"pkg/__init__.py": b"z = 3\n"})
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    lock = tmp_path / "carry.lock"
    lock.write_text(f"# roots\npkg==1.0 --hash=sha256:{digest}  # {wheel.name} via root\n"
                    f"other==2.0 --hash=sha256:{'0' * 64}  # other-2.0-py3-none-any.whl via pkg\n")
    assert carry.main(["pack", "--smoke", "--lock", str(lock), "--wheels", str(tmp_path)]) == 0
    plan = json.load(io.StringIO(capsys.readouterr().out))
    assert plan["pins"] == 2 and plan["wheels_present"] == 1 and plan["trims_unmatched"] is None
    assert 0 < plan["part_budget_mib"] < 64
    with pytest.raises(SystemExit, match="run `carry_vllm.py resolve`"):
        carry.main(["pack", "--smoke", "--lock", str(tmp_path / "missing.lock")])
